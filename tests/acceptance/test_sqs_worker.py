"""The SQS example worker as a user runs it (``consumer-kit run examples.sqs_worker:app``) against
moto's SNS and SQS and PostgreSQL: killed with SIGKILL mid-stream and started again, it records every
order once and announces each once (by outbox id); SIGTERM drains it and it exits 0 (the run itself:
:mod:`tests.acceptance.example_workers`). Its ``init`` on a machine with no AWS set up says in one
line what to set, and what it says, followed with moto's own ``moto_server`` command, works."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from consumer_kit.sources.sqs import MESSAGE_ID_ATTRIBUTE
from consumer_kit.testing.server import free_port
from tests.acceptance.example_workers import ROOT, Worker, kill_and_restart
from tests.conftest import TEST_HMAC_KEY
from tests.integration.sqs_env import REGION, Moto
from tests.processes import wait_until_served

ORDERS = 300


def no_aws(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine with no AWS set up: no AWS_ or SQS_ variable, no ~/.aws files, no
    instance or container role (the metadata service is not asked, so a CI host on EC2 has none either);
    the database a SQLite file of the test's own."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("AWS_", "SQS_"))}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws"),
               AWS_EC2_METADATA_DISABLED="true", DATABASE_URL=f"sqlite:///{tmp_path / 'consumer-kit.db'}")
    return env


def init(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m examples.sqs_worker init``, from the repository's root as its docstring runs it."""
    return subprocess.run([sys.executable, "-m", "examples.sqs_worker", "init"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2 and done.stdout == "", done
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("python -m examples.sqs_worker init: "), line
    return line


def test_init_without_aws_says_what_to_set(tmp_path: Path) -> None:
    line = one_line_error(init(no_aws(tmp_path)))
    assert "SQS needs a region (SQS_REGION, or AWS_REGION) and AWS credentials (AWS_ACCESS_KEY_ID and " \
           "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role)" in line, line
    assert "moto_server -p 5000" in line and "SQS_ENDPOINT_URL=http://127.0.0.1:5000" in line, line
    assert not (tmp_path / "consumer-kit.db").exists()  # asked before anything is made


def test_init_with_an_endpoint_that_is_not_there_names_it(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = dict(no_aws(tmp_path), SQS_ENDPOINT_URL=endpoint, SQS_REGION=REGION, AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_MAX_ATTEMPTS="1")
    line = one_line_error(init(env))
    assert f"cannot reach the SQS endpoint {endpoint} (EndpointConnectionError); check SQS_ENDPOINT_URL" in line


@pytest.mark.sqs
def test_init_works_once_the_line_is_followed(tmp_path: Path) -> None:
    advice = one_line_error(init(no_aws(tmp_path)))
    port = free_port()
    # moto's own command as the line gives it, on a free port instead of 5000.
    command = re.search(r"\((moto_server -p 5000)\b", advice)
    assert command is not None, advice
    words = command.group(1).replace("5000", str(port)).split()
    with (tmp_path / "moto.log").open("wb") as log:
        moto = subprocess.Popen([str(Path(sys.executable).with_name(words[0])), *words[1:]], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_until_served(moto, f"http://127.0.0.1:{port}/moto-api/")  # type: ignore[arg-type]
        settings = dict(re.findall(r"\b([A-Z][A-Z_]+)=(\S+)", advice.split(" and set ", 1)[1]))
        assert settings.keys() == {"SQS_ENDPOINT_URL", "SQS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        settings["SQS_ENDPOINT_URL"] = settings["SQS_ENDPOINT_URL"].replace("5000", str(port))
        done = init({**no_aws(tmp_path), **settings})
        assert done.returncode == 0, done.stderr
        sqs = boto3.client("sqs", endpoint_url=settings["SQS_ENDPOINT_URL"], region_name=settings["SQS_REGION"],
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        queues = {url.rsplit("/", 1)[1] for url in sqs.list_queues()["QueueUrls"]}
        assert queues == {"orders", "orders-dlq", "orders-events"}
    finally:
        moto.terminate()
        moto.wait(30)


@pytest.mark.sqs
@pytest.mark.postgres
async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, moto_endpoint: str, tmp_path: Path) -> None:
    moto = Moto(moto_endpoint)
    name = f"ck-orders-{secrets.token_hex(4)}"
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               SQS_ENDPOINT_URL=moto_endpoint, SQS_REGION=REGION, SQS_WAIT_TIME_SECONDS="1",
               ORDERS_TOPIC=name, ORDERS_QUEUE=name, EVENTS_QUEUE=f"{name}-events",
               ORDERS_VISIBILITY_SECONDS="3", INBOX_LEASE_SECONDS="2", DB_POOL_SIZE="5",
               OUTBOX_POLL_SECONDS="0.2", SHUTDOWN_GRACE_SECONDS="10")
    worker = Worker("sqs_worker", env, tmp_path / "worker.log")
    await worker.init()
    queue = (await asyncio.to_thread(moto.sqs.get_queue_url, QueueName=name))["QueueUrl"]
    events = (await asyncio.to_thread(moto.sqs.get_queue_url, QueueName=f"{name}-events"))["QueueUrl"]
    moto.created += [queue, events, queue + "-dlq"]
    topic = next(t["TopicArn"] for t in (await asyncio.to_thread(moto.sns.list_topics))["Topics"]
                 if t["TopicArn"].endswith(f":{name}"))

    def publish_all() -> None:
        for start in range(0, ORDERS, 10):
            moto.sns.publish_batch(TopicArn=topic, PublishBatchRequestEntries=[
                {"Id": str(i), "Message": json.dumps({"order": f"O-{i}", "amount": i})}
                for i in range(start, start + 10)])

    async def held() -> int:
        return await moto.depth(queue)

    try:
        await kill_and_restart(worker, pg_database, orders=ORDERS, publish=lambda: asyncio.to_thread(publish_all),
                               depth=held, kill_after=60, finish_seconds=120)
        announcements = await moto.drain(events)
    finally:
        await moto.cleanup()
    assert {json.loads(m["Body"])["order"] for m in announcements} == {f"O-{i}" for i in range(ORDERS)}
    # A repeat can only be a row the killed relay had sent but not recorded: same outbox id, same body.
    by_id: dict[str, set[str]] = {}
    for message in announcements:
        by_id.setdefault(message["MessageAttributes"][MESSAGE_ID_ATTRIBUTE]["StringValue"], set()).add(message["Body"])
    assert len(by_id) == ORDERS and all(len(bodies) == 1 for bodies in by_id.values())
