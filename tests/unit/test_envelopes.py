"""Envelopes and explicit keys, without a broker: which id each envelope keys by, what the handler
sees, and the reason a message that does not fit is parked with."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from consumer_kit import Delivery, InvalidKey, MissingStableId
from consumer_kit.errors import ConfigurationError
from consumer_kit.sources.envelopes import (
    EnvelopedSource,
    EnvelopeMismatch,
    Unwrapped,
    amqp_cloudevent,
    is_s3_test_event,
    unwrap,
)

SNS = {
    "Type": "Notification", "MessageId": "5a1b-sns", "TopicArn": "arn:aws:sns:us-east-1:123456789012:orders",
    "Subject": "created", "Message": '{"order": "O-1"}', "Timestamp": "2024-05-01T12:00:00.000Z",
    "MessageAttributes": {"order-id": {"Type": "String", "Value": "O-1"}},
}
EVENTBRIDGE = {
    "version": "0", "id": "eb-77", "detail-type": "Order Created", "source": "com.example.orders",
    "account": "123456789012", "time": "2024-05-01T12:00:00Z", "region": "us-east-1", "resources": [],
    "detail": {"order": "O-1"},
}


def s3_record(key: str = "in/a.csv", *, sequencer: str | None = "0055AED6DCD90281E5", version: str = "v1") -> dict:
    obj: dict[str, object] = {"key": key, "size": 3, "eTag": "abc", "versionId": version}
    if sequencer is not None:
        obj["sequencer"] = sequencer
    return {"eventVersion": "2.1", "eventSource": "aws:s3", "eventName": "ObjectCreated:Put",
            "s3": {"bucket": {"name": "uploads"}, "object": obj}}


def one(envelope: str, body: object, headers: dict[str, str] | None = None) -> Delivery:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    [delivery] = unwrap(envelope, message_id="sqs-id-1", body=raw, headers=headers or {}, attempt=2)
    return delivery


def key_of(delivery: Delivery, **options: object) -> str:
    return str(EnvelopedSource(namespace="orders", version=1, **options).key(delivery))  # type: ignore[arg-type]


def reason_of(delivery: Delivery, **options: object) -> str:
    with pytest.raises((MissingStableId, InvalidKey)) as caught:
        EnvelopedSource(namespace="orders", version=1, **options).key(delivery)  # type: ignore[arg-type]
    return str(caught.value.reason)


def test_sqs_keys_by_the_message_id_and_passes_the_body() -> None:
    delivery = one("sqs", b"hello", {"order-id": "O-1"})
    assert key_of(delivery) == "orders:v1:sqs-id-1"
    assert (delivery.body, delivery.attempt, delivery.headers["order-id"]) == (b"hello", 2, "O-1")


def test_sns_keys_by_topic_and_sns_message_id_and_unwraps_the_message() -> None:
    delivery = one("sns", SNS)
    assert key_of(delivery) == "orders:v1:arn:aws:sns:us-east-1:123456789012:orders#5a1b-sns"
    assert delivery.json() == {"order": "O-1"}
    assert delivery.headers["order-id"] == "O-1" and delivery.headers["sns-subject"] == "created"
    assert delivery.attributes == {"sns-topic-arn": SNS["TopicArn"], "sns-subject": "created"}


@pytest.mark.parametrize("body", [
    b"not json", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe",
    {"Type": "SubscriptionConfirmation", "TopicArn": "t", "MessageId": "m"},
    {"order": "O-1"}, {"Type": "Notification", "TopicArn": "t", "MessageId": "m", "Message": 5},
])
def test_sns_parks_what_is_not_a_notification_as_envelope_mismatch(body: object) -> None:
    delivery = one("sns", body)
    assert isinstance(delivery, Unwrapped) and delivery.mismatch
    assert reason_of(delivery) == "envelope_mismatch"
    # The raw message is what gets parked, not a guess at its inside.
    assert delivery.body == (body if isinstance(body, bytes) else json.dumps(body).encode())
    # key= does not rescue a message in the wrong envelope.
    assert reason_of(delivery, key="order-id") == "envelope_mismatch"


def test_sns_without_its_ids_is_missing_stable_id_unless_key_finds_one() -> None:
    delivery = one("sns", {k: v for k, v in SNS.items() if k != "MessageId"})
    assert reason_of(delivery) == "missing_stable_id"
    assert key_of(delivery, key="order-id") == "orders:v1:O-1"


def test_eventbridge_keys_by_source_and_id_and_unwraps_the_detail() -> None:
    delivery = one("eventbridge", EVENTBRIDGE)
    assert key_of(delivery) == "orders:v1:com.example.orders#eb-77"
    assert delivery.json() == {"order": "O-1"}
    assert delivery.headers["eventbridge-detail-type"] == "Order Created"
    assert reason_of(one("eventbridge", {"id": "x", "source": "y"})) == "envelope_mismatch"
    assert reason_of(one("eventbridge", {**EVENTBRIDGE, "id": ""})) == "missing_stable_id"


def test_key_parts_cannot_run_into_each_other() -> None:
    # "a#b" + "c" and "a" + "b#c" must not make the same id.
    first = one("eventbridge", {**EVENTBRIDGE, "source": "a#b", "id": "c"})
    second = one("eventbridge", {**EVENTBRIDGE, "source": "a", "id": "b#c"})
    assert key_of(first) != key_of(second)


def test_s3_gives_one_delivery_per_record_keyed_by_bucket_key_version_and_sequencer() -> None:
    body = json.dumps({"Records": [s3_record("in/a.csv"), s3_record("in/b.csv", sequencer="0055AED6DCD90281E6")]})
    first, second = unwrap("s3", message_id="m", body=body.encode(), headers={})
    assert key_of(first) == "orders:v1:uploads#in/a.csv#v1#0055AED6DCD90281E5"
    assert key_of(second) == "orders:v1:uploads#in/b.csv#v1#0055AED6DCD90281E6"
    assert first.json()["s3"]["object"]["key"] == "in/a.csv" and first.headers["s3-bucket"] == "uploads"
    encoded = one("s3", {"Records": [s3_record("in%2Fmy+file.csv")]})
    assert encoded.headers["s3-key"] == "in/my file.csv"  # S3 URL-encodes keys; the header is decoded
    assert key_of(encoded) == "orders:v1:uploads#in%252Fmy+file.csv#v1#0055AED6DCD90281E5"  # "%" escaped


def test_s3_long_object_keys_are_named_by_their_digest_so_the_key_stays_within_255_bytes() -> None:
    long_key = "deep/" * 100 + "file.csv"
    delivery = one("s3", {"Records": [s3_record(long_key)]})
    digest = hashlib.sha256(long_key.encode()).hexdigest()
    assert key_of(delivery) == f"orders:v1:uploads#sha256:{digest}#v1#0055AED6DCD90281E5"


def test_s3_record_without_sequencer_is_missing_stable_id_and_test_event_is_no_delivery() -> None:
    assert reason_of(one("s3", {"Records": [s3_record(sequencer=None)]})) == "missing_stable_id"
    assert reason_of(one("s3", {"Records": [{"s3": {}}]})) == "envelope_mismatch"
    assert reason_of(one("s3", {"nothing": 1})) == "envelope_mismatch"
    test_event = json.dumps({"Service": "Amazon S3", "Event": "s3:TestEvent", "Bucket": "uploads"}).encode()
    assert unwrap("s3", message_id="m", body=test_event, headers={}) == []
    assert is_s3_test_event(test_event) and not is_s3_test_event(b'{"Records": []}')


def structured(**changes: object) -> dict[str, object]:
    event: dict[str, object] = {"specversion": "1.0", "id": "ev-1", "source": "/orders", "type": "order.created",
                                "datacontenttype": "application/json", "data": {"order": "O-1"}}
    event.update(changes)
    return {k: v for k, v in event.items() if v is not None}


def test_cloudevents_structured_keys_like_the_http_sink_and_unwraps_the_data() -> None:
    from consumer_kit.sources.cloudevents import cloudevent_key_mapper

    delivery = one("cloudevents", structured())
    assert key_of(delivery) == "orders:v1:/orders#ev-1"
    assert delivery.id == cloudevent_key_mapper(Delivery(id=None, body=json.dumps(structured()).encode()))
    assert delivery.json() == {"order": "O-1"}
    assert delivery.headers["ce-type"] == "order.created" and delivery.headers["content-type"] == "application/json"
    binary = one("cloudevents", structured(datacontenttype="application/octet-stream", data=None,
                                           data_base64=base64.b64encode(b"\x00\x01").decode()))
    assert binary.body == b"\x00\x01"


@pytest.mark.parametrize(("event", "reason"), [
    (structured(specversion="0.3"), "envelope_mismatch"),
    (structured(type=None), "envelope_mismatch"),
    (structured(data_base64="***"), "envelope_mismatch"),
    (structured(subject={"nested": True}), "envelope_mismatch"),
    (structured(id=None), "missing_stable_id"),
])
def test_cloudevents_that_do_not_fit_are_parked_with_their_reason(event: dict[str, object], reason: str) -> None:
    assert reason_of(one("cloudevents", event)) == reason


def test_amqp_binary_mode_reads_cloudevents_application_properties() -> None:
    raw = Delivery(id="amqp-random-id", body=b'{"order": "O-1"}', headers={
        "cloudEvents_specversion": "1.0", "cloudEvents_id": "ev-1", "cloudEvents:source": "/orders",
        "cloudEvents_type": "order.created", "x-trace": "t-1"})
    delivery = amqp_cloudevent(raw, "application/json")
    assert key_of(delivery) == "orders:v1:/orders#ev-1"  # not the AMQP message_id
    assert delivery.headers["ce-source"] == "/orders" and delivery.headers["x-trace"] == "t-1"
    assert delivery.json() == {"order": "O-1"}
    structured_mode = amqp_cloudevent(Delivery(id="x", body=json.dumps(structured()).encode()),
                                      "application/cloudevents+json; charset=utf-8")
    assert key_of(structured_mode) == "orders:v1:/orders#ev-1"
    assert reason_of(amqp_cloudevent(Delivery(id="x", body=b"{}"), "application/json")) == "envelope_mismatch"
    assert reason_of(amqp_cloudevent(Delivery(id="x", body=b"[" * 100_000), "application/cloudevents+json")) == \
        "envelope_mismatch"
    assert reason_of(amqp_cloudevent(Delivery(id="x", body=b"[]"), "application/cloudevents-batch+json")) == \
        "envelope_mismatch"


def test_key_by_attribute_name() -> None:
    delivery = Delivery(id="transport-id", body=b"{}", headers={"order-id": "O-7"})
    assert key_of(delivery, key="order-id") == "orders:v1:O-7"
    assert reason_of(Delivery(id="transport-id", body=b"{}"), key="order-id") == "missing_stable_id"
    assert reason_of(Delivery(id="transport-id", body=b"{}", headers={"order-id": ""}), key="order-id") == \
        "missing_stable_id"
    assert reason_of(Delivery(id="t", body=b"{}", headers={"order-id": " O-7"}), key="order-id") == "invalid_key"


def test_key_by_callable_is_validated_and_a_failing_callable_parks_instead_of_retrying() -> None:
    delivery = Delivery(id="transport-id", body=b'{"order": "O-9"}')
    assert key_of(delivery, key=lambda d: d.json()["order"]) == "orders:v1:O-9"
    assert reason_of(Delivery(id="t", body=b"{}"), key=lambda d: d.json()["order"]) == "missing_stable_id"
    assert reason_of(delivery, key=lambda d: 42) == "invalid_key"
    assert reason_of(delivery, key=lambda d: None) == "missing_stable_id"


def test_key_options_are_checked_at_construction() -> None:
    with pytest.raises(ConfigurationError):
        EnvelopedSource(namespace="orders", version=1, key="a", key_mapper=lambda d: d.id)
    with pytest.raises(ConfigurationError):
        EnvelopedSource(namespace="orders", version=1, key="")
    with pytest.raises(ConfigurationError):
        EnvelopedSource(namespace="orders", version=1, key=42)  # type: ignore[arg-type]


def test_a_missing_key_error_never_carries_the_value() -> None:
    secret_id = "customer-4711-order"
    with pytest.raises(MissingStableId) as caught:
        EnvelopedSource(namespace="orders", version=1, key=lambda d: {}[secret_id]).key(Delivery(id="t", body=b""))
    assert secret_id not in str(caught.value)
    assert isinstance(caught.value, MissingStableId) and not isinstance(caught.value, EnvelopeMismatch)
