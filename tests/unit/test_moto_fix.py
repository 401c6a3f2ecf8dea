"""The moto server the SQS tests run (consumer_kit.testing.moto) takes the SQS requests that add or
remove messages one at a time, so that a send can never land in a message list that a concurrent
delete throws away; receives (long polls) still run side by side."""

from __future__ import annotations

import io
import threading
import time
from typing import Any

from consumer_kit.testing.moto import SerialisedWrites


class Recorder:
    """A WSGI app that notes how many requests it is inside at once."""

    def __init__(self) -> None:
        self.inside = self.most = 0
        self.lock = threading.Lock()
        self.bodies: list[bytes] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        self.bodies.append(environ["wsgi.input"].read())
        time.sleep(0.05)
        with self.lock:
            self.inside -= 1
        start_response("200 OK", [])
        return [b"ok"]


def concurrently(app: SerialisedWrites, environs: list[dict[str, Any]]) -> None:
    threads = [threading.Thread(target=app, args=(environ, lambda *a: None)) for environ in environs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)


def json_request(action: str) -> dict[str, Any]:
    return {"HTTP_X_AMZ_TARGET": f"AmazonSQS.{action}", "wsgi.input": io.BytesIO(b"{}")}


def test_sends_and_deletes_run_one_at_a_time() -> None:
    inner = Recorder()
    concurrently(SerialisedWrites(inner), [json_request(a) for a in ("SendMessage", "DeleteMessage",
                                                                      "SendMessageBatch", "DeleteMessageBatch")])
    assert inner.most == 1


def test_receives_still_run_side_by_side() -> None:
    inner = Recorder()
    concurrently(SerialisedWrites(inner), [json_request("ReceiveMessage") for _ in range(4)])
    assert inner.most > 1


def test_the_query_protocol_is_recognised_and_its_body_handed_on() -> None:
    inner = Recorder()
    body = b"Action=DeleteMessage&QueueUrl=x&ReceiptHandle=y"
    concurrently(SerialisedWrites(inner), [
        {"CONTENT_TYPE": "application/x-www-form-urlencoded", "CONTENT_LENGTH": str(len(body)),
         "wsgi.input": io.BytesIO(body)} for _ in range(3)])
    assert inner.most == 1 and inner.bodies == [body] * 3
