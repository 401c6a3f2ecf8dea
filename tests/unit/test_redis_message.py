"""The Redis Streams source's pure parts: reading an entry into a delivery, the copies it writes, the
retry delay, and the connection text."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import redis.exceptions

from consumer_kit.delivery import RefusedReplay, Replayed
from consumer_kit.replay import REPLAY_HEADER, seal
from consumer_kit.sources.pulling import retry_delay
from consumer_kit.sources.redis import ENTRY_ID_FIELD, KEY_DIGEST_FIELD, REASON_FIELD, SOURCE_STREAM_FIELD, Entry
from consumer_kit.sources.redis.connection import client_name, safe_url, unreachable
from consumer_kit.sources.redis.message import dead_letter_copy, entry_order, replay_copy, sent_at, to_delivery
from tests.conftest import make_settings


def test_an_entry_is_keyed_by_stream_and_id_with_its_other_fields_as_text_headers() -> None:
    entry = Entry("1700000000123-4", {b"body": b"\xffraw", b"origin": b"caf\xc3\xa9", b"bad": b"\xfe"}, attempt=3)
    delivery = to_delivery(entry, "orders", b"body")
    assert (delivery.id, delivery.body, delivery.attempt) == ("orders:1700000000123-4", b"\xffraw", 3)
    assert delivery.headers == {"origin": "café", "bad": "\ufffd"}
    assert delivery.attributes == {}
    assert delivery.sent_at == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)


def test_an_entry_without_the_body_field_has_all_its_fields_as_a_json_object() -> None:
    delivery = to_delivery(Entry("5-0", {b"order": b"7", b"kind": b"paid"}), "s", b"body")
    assert json.loads(delivery.body) == {"order": "7", "kind": "paid"}
    assert list(json.loads(delivery.body)) == ["order", "kind"]  # in the entry's order


def test_ids_order_by_milliseconds_then_sequence() -> None:
    assert sorted(["10-2", "9-10", "10-10"], key=entry_order) == ["9-10", "10-2", "10-10"]
    assert sent_at("not-an-id") is None


def test_the_dead_letter_copy_keeps_the_fields_and_says_why_without_the_key() -> None:
    entry = Entry("1-1", {b"body": b"x", b"message-id": b"m-1", REASON_FIELD.encode(): b"older"})
    copy = dead_letter_copy(entry, "orders", "poison", "abcd1234")
    assert copy == {b"body": b"x", b"message-id": b"m-1", REASON_FIELD.encode(): b"poison",
                    SOURCE_STREAM_FIELD.encode(): b"orders", ENTRY_ID_FIELD.encode(): b"1-1",
                    KEY_DIGEST_FIELD.encode(): b"abcd1234"}
    assert KEY_DIGEST_FIELD.encode() not in dead_letter_copy(entry, "orders", "unreadable", None)


def test_a_replay_copy_reads_back_as_the_parked_delivery_and_a_forged_one_is_refused() -> None:
    digester = make_settings("sqlite+aiosqlite:///unused.db").digester()
    parked = Replayed(id="orders:1-1", body=b"x", headers={"origin": "a", REASON_FIELD: "poison"}, parked_id="p1")
    fields = replay_copy(parked, seal(parked, digester), "body")
    assert REASON_FIELD not in fields
    raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    again = to_delivery(Entry("2-0", raw, attempt=1), "orders", b"body", digester)
    assert isinstance(again, Replayed) and (again.id, again.body, again.parked_id) == ("orders:1-1", b"x", "p1")
    raw[REPLAY_HEADER.encode()] = raw[REPLAY_HEADER.encode()].replace(b"orders:1-1", b"orders:9-9")
    assert isinstance(to_delivery(Entry("3-0", raw), "orders", b"body", digester), RefusedReplay)


@pytest.mark.parametrize(("attempt", "wanted", "delays", "expected"), [
    (1, None, (1.0, 5.0), 1.0), (2, None, (1.0, 5.0), 5.0), (7, None, (1.0, 5.0), 5.0),
    (1, 3.0, (1.0, 5.0), 3.0), (1, 0.1, (), 0.1), (1, None, (), 0.0)])
def test_the_retry_delay_is_the_larger_of_the_pipelines_and_the_attempts_step(
        attempt: int, wanted: float | None, delays: tuple[float, ...], expected: float) -> None:
    assert retry_delay(delays, attempt, wanted) == expected


def test_the_connection_text_never_shows_the_password() -> None:
    assert safe_url("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert safe_url("rediss://u:hunter2@h/1") == "rediss://u:***@h/1"
    assert safe_url("redis://h:6379") == "redis://h:6379"
    error = unreachable(redis.exceptions.AuthenticationError("invalid password"), "redis://:hunter2@h:6379/0", "x")
    assert str(error) == "cannot connect to Redis at redis://:***@h:6379/0 for x: the server refused the login " \
                         "(wrong user name or password, or a password is needed)"
    assert client_name("redis:my stream\n") == "consumer-kit:redis:my-stream-"
