"""The NATS source's pure parts: reading a JetStream message into a delivery (by Nats-Msg-Id or by
stream and sequence, the attempt from num_delivered), the headers of a dead-letter copy and of a
replayed parked delivery, and the connection text that never shows a password."""

from __future__ import annotations

from datetime import UTC, datetime

import nats.errors
import pytest
from nats.aio.msg import Msg

from consumer_kit import ConfigurationError
from consumer_kit.delivery import RefusedReplay, Replayed
from consumer_kit.replay import REPLAY_HEADER, seal
from consumer_kit.sources.nats import (
    KEY_DIGEST_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    REASON_HEADER,
    SOURCE_SEQUENCE_HEADER,
    SOURCE_STREAM_HEADER,
    SOURCE_SUBJECT_HEADER,
    NatsSource,
    to_delivery,
    unreachable,
)
from consumer_kit.sources.nats.message import dead_letter_headers, replay_headers
from tests.conftest import make_settings

STORED_AT_NS = 1_700_000_000_123_000_000


def message(headers: dict[str, str] | None = None, *, delivered: int = 1, sequence: int = 42,
            data: bytes = b'{"order": 7}', subject: str = "orders.paid") -> Msg:
    """A message as a pull consumer hands it over: its metadata is in the reply subject (v1 tokens)."""
    reply = f"$JS.ACK.ORDERS.workers.{delivered}.{sequence}.3.{STORED_AT_NS}.0"
    return Msg(_client=None, subject=subject, reply=reply, data=data, headers=headers)  # type: ignore[arg-type]


def test_a_message_is_keyed_by_its_nats_msg_id_with_the_attempt_from_num_delivered() -> None:
    delivery = to_delivery(message({MSG_ID_HEADER: "order-7", "origin": "shop"}, delivered=3), "msg-id")
    assert (delivery.id, delivery.body, delivery.attempt) == ("order-7", b'{"order": 7}', 3)
    assert delivery.headers == {MSG_ID_HEADER: "order-7", "origin": "shop", "nats-subject": "orders.paid",
                                "nats-stream": "ORDERS", "nats-sequence": "42"}
    assert delivery.attributes == {"subject": "orders.paid"}
    assert delivery.sent_at == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)


def test_without_nats_msg_id_there_is_no_stable_id_and_by_sequence_there_always_is() -> None:
    assert to_delivery(message(), "msg-id").id is None
    assert to_delivery(message({MSG_ID_HEADER: ""}), "msg-id").id is None  # an empty header is no id
    assert to_delivery(message({MSG_ID_HEADER: "order-7"}, delivered=2), "sequence").id == "ORDERS:42"
    assert to_delivery(message(delivered=5), "sequence").id == "ORDERS:42"  # a redelivery keeps it


def test_a_dead_letter_copy_says_why_and_where_from_with_the_keys_digest_only() -> None:
    parked = message({MSG_ID_HEADER: "order-7", "origin": "shop", REASON_HEADER: "an older one"})
    headers = dead_letter_headers(parked, "retries_exhausted", "abcd1234abcd1234")
    assert headers == {"origin": "shop", ORIGINAL_MSG_ID_HEADER: "order-7", REASON_HEADER: "retries_exhausted",
                       SOURCE_STREAM_HEADER: "ORDERS", SOURCE_SEQUENCE_HEADER: "42",
                       SOURCE_SUBJECT_HEADER: "orders.paid", MSG_ID_HEADER: "ORDERS:42",
                       KEY_DIGEST_HEADER: "abcd1234abcd1234"}
    unkeyed = dead_letter_headers(message(), "missing_stable_id", None)
    assert KEY_DIGEST_HEADER not in unkeyed and ORIGINAL_MSG_ID_HEADER not in unkeyed


def test_a_replayed_copy_reads_back_as_the_parked_delivery_and_a_forged_one_is_refused() -> None:
    digester = make_settings("sqlite+aiosqlite:///unused.db").digester()
    parked = Replayed(id="order-7", body=b"x", headers={MSG_ID_HEADER: "order-7", "origin": "a",
                                                         "nats-sequence": "42", REASON_HEADER: "poison"},
                      attributes={"subject": "orders.paid"}, parked_id="p1")
    headers = replay_headers(parked, seal(parked, digester))
    # No Nats-Msg-Id: inside the duplicate window the stream would drop the copy as a repeat.
    assert set(headers) == {"origin", REPLAY_HEADER}
    again = to_delivery(message(headers, data=b"x", sequence=99, delivered=1), "msg-id", digester)
    assert isinstance(again, Replayed) and (again.id, again.body, again.parked_id) == ("order-7", b"x", "p1")
    forged = dict(headers, **{REPLAY_HEADER: headers[REPLAY_HEADER].replace("order-7", "order-8")})
    assert isinstance(to_delivery(message(forged, data=b"x"), "msg-id", digester), RefusedReplay)


def test_the_connection_text_never_shows_the_password() -> None:
    refused = unreachable(ConnectionRefusedError(), "nats://alice:hunter2@h:4222, tls://tok3n@g", "nats:S/d")
    assert str(refused) == ("cannot connect to NATS at nats://***@h:4222,tls://***@g for nats:S/d: connection "
                            "refused (nothing listens there: is nats-server running, and is the port right?)")
    login = unreachable(nats.errors.AuthorizationError(), "nats://alice:hunter2@h:4222", "the outbox relay")
    assert "hunter2" not in str(login) and str(login).endswith("the server refused the login (wrong user, "
                                                               "password or token)")
    assert "no server answered" in str(unreachable(nats.errors.NoServersError(), "nats://h", "x"))


@pytest.mark.parametrize(("options", "says"), [
    ({"stable_id": "subject"}, "unknown stable_id"), ({"envelope": "sqs"}, "unknown envelope"),
    ({"ack_wait_seconds": 0}, "ack_wait_seconds must be positive"), ({"retry_delays": ()}, "at least one"),
    ({"max_in_flight": 0}, "max_in_flight must be at least 1")])
def test_a_source_refuses_a_wrong_option_at_once(options: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        NatsSource(stream="S", subject="s.>", namespace="orders", version=1, **options)  # type: ignore[arg-type]


def test_the_durable_defaults_to_the_namespace_made_a_legal_name() -> None:
    source = NatsSource(stream="ORDERS", subject="orders.>", namespace="shop.orders v2", version=1,
                        dead_letter_subject="dl.{stream}")
    assert source.durable == "consumer-kit-shop-orders-v2"
    assert source.name == "nats:ORDERS/consumer-kit-shop-orders-v2"
    assert (source.dead_letter_subject, source.dead_letter_stream) == ("dl.ORDERS", "ORDERS_DEAD_LETTER")
