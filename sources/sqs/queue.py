"""What an SQS source learns about its queue at start, and the checks that refuse a start that could
not work (an unreachable endpoint, a missing queue, a heartbeat no shorter than the visibility
timeout, parked messages with nowhere to go)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from consumer_kit.errors import ConfigurationError
from consumer_kit.sources.sqs.client import SqsClient, explain, log
from consumer_kit.untrusted import loads_json


@dataclass(frozen=True, slots=True)
class QueueFacts:
    """The queue as the source will use it."""

    url: str
    fifo: bool
    visibility_timeout: int  # the one in force: the source's, else the queue's
    heartbeat: float  # seconds between visibility extensions
    redrive: tuple[str, int] | None  # the redrive policy: (dead-letter queue ARN, maxReceiveCount)


async def inspect_queue(sqs: SqsClient, *, source: str, queue_url: str | None, queue_name: str | None,
                        visibility_timeout: int | None, heartbeat_interval: float | None,
                        dead_letter_queue_url: str | None, max_deliveries: int) -> QueueFacts:
    """Open the client and read the queue's attributes; raise ConfigurationError, saying what to do,
    when the source cannot work with them. Warns when the redrive policy would move a message before
    the pipeline parks it (``maxReceiveCount`` <= ``MAX_DELIVERIES``)."""
    try:
        await sqs.open()
        url = queue_url or (await sqs.call("get_queue_url", QueueName=queue_name))["QueueUrl"]
        attributes = (await sqs.call("get_queue_attributes", QueueUrl=url,
                                     AttributeNames=["All"])).get("Attributes", {})
    except Exception as exc:
        raise ConfigurationError(f"{source}: cannot use SQS queue {queue_url or queue_name}: "
                                 f"{explain(exc, sqs.endpoint_url)}") from exc
    fifo = attributes.get("FifoQueue") == "true"
    timeout = visibility_timeout or int(attributes.get("VisibilityTimeout", 30))
    heartbeat = heartbeat_interval or timeout / 3
    if heartbeat <= 0 or heartbeat >= timeout:
        raise ConfigurationError(
            f"{source}: the visibility heartbeat ({heartbeat:g}s) must be shorter than the visibility timeout "
            f"({timeout}s), or messages reappear while their handler runs")
    redrive = _redrive_policy(attributes)
    if redrive is not None and redrive[1] <= max_deliveries:
        log.warning(
            "%s: the queue's redrive policy moves a message to its dead-letter queue after %d receives, and "
            "MAX_DELIVERIES is %d: SQS would move a failing message before consumer-kit parks it with its "
            "reason. Raise maxReceiveCount above MAX_DELIVERIES.", source, redrive[1], max_deliveries)
    if dead_letter_queue_url is not None:
        try:
            dlq = (await sqs.call("get_queue_attributes", QueueUrl=dead_letter_queue_url,
                                  AttributeNames=["FifoQueue"])).get("Attributes", {})
        except Exception as exc:
            raise ConfigurationError(f"{source}: cannot use the dead-letter queue {dead_letter_queue_url}: "
                                     f"{explain(exc, sqs.endpoint_url)}") from exc
        if (dlq.get("FifoQueue") == "true") != fifo:
            kind = "FIFO" if fifo else "standard"
            raise ConfigurationError(f"{source}: the dead-letter queue of a {kind} queue must be {kind} too")
    elif redrive is not None:
        log.info("%s: no dead_letter_queue_url: parked messages are left to the queue's redrive policy (to %s "
                 "after %d receives)", source, redrive[0], redrive[1])
    else:
        raise ConfigurationError(
            f"{source}: the queue has no redrive policy and no dead_letter_queue_url was given, so a parked "
            "message would come back forever: pass dead_letter_queue_url= or give the queue a RedrivePolicy")
    return QueueFacts(url=url, fifo=fifo, visibility_timeout=timeout, heartbeat=heartbeat, redrive=redrive)


def _redrive_policy(attributes: Mapping[str, str]) -> tuple[str, int] | None:
    raw = attributes.get("RedrivePolicy")
    if not raw:
        return None
    try:
        policy = loads_json(raw, strict=False)
        return str(policy["deadLetterTargetArn"]), int(policy["maxReceiveCount"])
    except (ValueError, KeyError, TypeError):
        return None
