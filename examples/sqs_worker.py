"""An SQS worker: orders published to an SNS topic reach ``ORDERS_QUEUE`` (SNS -> SQS); each is
recorded in PostgreSQL and announced on ``EVENTS_QUEUE`` through the outbox.

Run it the way production would::

    export DATABASE_URL=postgresql://app@db/app IDEMPOTENCY_HMAC_KEY=... SQS_REGION=eu-west-1
    # credentials: boto3's usual chain (AWS_PROFILE, the task or instance role, ...); no AWS:
    # SQS_ENDPOINT_URL=http://127.0.0.1:5000 for moto's server (moto_server -p 5000), :4566 for LocalStack
    consumer-kit db upgrade
    python -m examples.sqs_worker init      # the example's table, and the topic and queues if missing
                                            # (without AWS settings: one line saying what to set)
    consumer-kit run examples.sqs_worker:app --port 8000   # and /healthz, /readyz, /metrics

Publish ``{"order": "O-1", "amount": 12}`` to the ``ORDERS_TOPIC`` topic. The source unwraps the SNS
envelope and keys each order by the topic and SNS's own ``MessageId`` (the same on every SNS retry);
the handler inserts one ``example_sqs_orders`` row and stages an ``order.recorded`` event for
``EVENTS_QUEUE`` in the same transaction; the relay that ``consumer-kit run`` starts sends it with the
outbox row id in the ``x-consumer-kit-message-id`` attribute, which is what a consumer of the events
keys by (``key=MESSAGE_ID_ATTRIBUTE``). Parked orders go to ``<ORDERS_QUEUE>-dlq`` through the
queue's redrive policy (``init`` sets ``maxReceiveCount`` above ``MAX_DELIVERIES``). A worker killed
at any point and started again records each order once.
"""

from __future__ import annotations

import asyncio
import json
import os

import boto3
import botocore.exceptions
from sqlalchemy import MetaData

from consumer_kit import ConfigurationError, ConsumerApp, Context, Settings
from consumer_kit.sources.sqs import SqsPublisher, SQSSource
from consumer_kit.sources.sqs.client import explain
from examples import create_tables
from examples.orders import main, orders_table, record

# What a first try without an AWS account needs; the same endpoint the SQS page of the docs starts.
LOCAL_ENDPOINT = ("to try it without AWS, start a local endpoint (moto_server -p 5000, from pip install "
                  "'moto[server]') and set SQS_ENDPOINT_URL=http://127.0.0.1:5000 SQS_REGION=us-east-1 "
                  "AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing")

ORDERS_TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
ORDERS_QUEUE = os.environ.get("ORDERS_QUEUE", "orders")
EVENTS_QUEUE = os.environ.get("EVENTS_QUEUE", f"{ORDERS_QUEUE}-events")

metadata = MetaData()
orders = orders_table("example_sqs_orders", metadata)

settings = Settings()
app = ConsumerApp(settings)
source = SQSSource(queue_name=ORDERS_QUEUE, namespace="sqs-orders", version=1, envelope="sns",
                   max_in_flight=int(os.environ.get("ORDERS_MAX_IN_FLIGHT", "32")), retry_delays=(1.0, 5.0, 30.0))
app.relay_outbox(SqsPublisher(settings=settings))


@app.handler(source, name="record-sqs-order")
async def record_order(ctx: Context) -> None:
    """Record the order and announce it; both commit with the inbox row or not at all."""
    event = await record(ctx, orders)
    ctx.outbox.publish(EVENTS_QUEUE, json.dumps(event), headers={"content-type": "application/json"})


async def init() -> None:
    """Create the topic, the queues (the orders queue with a redrive policy to its dead-letter queue)
    and the subscription unless they exist, then the example's table. In production these come from
    your infrastructure code; the calls are idempotent. AWS's answer to a missing region or credentials,
    or an endpoint it cannot reach, is a ConfigurationError of one line that says what to set."""
    missing = await asyncio.to_thread(_missing_aws_settings)
    if missing:
        raise ConfigurationError(f"SQS needs {' and '.join(missing)}; {LOCAL_ENDPOINT}")
    try:
        await asyncio.to_thread(_create_topic_and_queues)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise ConfigurationError(f"{explain(exc, settings.sqs_endpoint_url)}; {LOCAL_ENDPOINT}") from None
    await create_tables(settings, metadata)


def _missing_aws_settings() -> list[str]:
    """What boto3's chains do not find (a thread: the credential chain may ask the instance's metadata)."""
    session = boto3.Session(region_name=settings.sqs_region)
    missing = [] if session.region_name else ["a region (SQS_REGION, or AWS_REGION)"]
    if session.get_credentials() is None:
        missing.append("AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role)")
    return missing


def _create_topic_and_queues() -> None:
    where = {"endpoint_url": settings.sqs_endpoint_url, "region_name": settings.sqs_region}
    sqs, sns = boto3.client("sqs", **where), boto3.client("sns", **where)

    def arn(url: str) -> str:
        return str(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"])

    dlq = sqs.create_queue(QueueName=f"{ORDERS_QUEUE}-dlq")["QueueUrl"]
    redrive = {"deadLetterTargetArn": arn(dlq), "maxReceiveCount": settings.max_deliveries + 5}
    queue = sqs.create_queue(QueueName=ORDERS_QUEUE, Attributes={
        "RedrivePolicy": json.dumps(redrive),
        "VisibilityTimeout": os.environ.get("ORDERS_VISIBILITY_SECONDS", "30")})["QueueUrl"]
    sqs.create_queue(QueueName=EVENTS_QUEUE)
    topic = sns.create_topic(Name=ORDERS_TOPIC)["TopicArn"]
    # The queue must let SNS send to it: only this topic.
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": "sns.amazonaws.com"}, "Action": "sqs:SendMessage",
        "Resource": arn(queue), "Condition": {"ArnEquals": {"aws:SourceArn": topic}}}]}
    sqs.set_queue_attributes(QueueUrl=queue, Attributes={"Policy": json.dumps(policy)})
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn(queue))


if __name__ == "__main__":
    main("examples.sqs_worker", init)
