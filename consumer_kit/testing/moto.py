"""moto's server (``moto[server]``) as an SQS endpoint for tests and benchmarks, in a process of its own.

:func:`moto_server` starts it on a free loopback port and yields its URL::

    with moto_server() as endpoint:
        settings = Settings(sqs_endpoint_url=endpoint, sqs_region="us-east-1", ...)

A process rather than moto's in-process ``ThreadedMotoServer``: moto does most of the work in an SQS
test (it scans the queue on every receive), and inside the test's process it would contend for the
GIL with the event loop and the source's boto3 threads.

The server runs with one fix (:class:`SerialisedWrites`): moto's delete builds a new message list and
assigns it without the queue's lock, while a send appends to the list under that lock; a message sent
by one request thread while another deletes is appended to the old list and lost. Real SQS loses
nothing; without the fix a test that sends while a consumer deletes (a live producer) sometimes ends a
message short with the queue empty, which is moto's loss, not the consumer's. The fix is a WSGI
middleware around moto's public application: the SQS requests that add or remove messages run one at
a time (receives, long polls included, still run side by side). Run as
``python -m consumer_kit.testing.moto -H HOST -p PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def moto_server(*, timeout: float = 60.0) -> Iterator[str]:
    """moto's server on a free loopback port, in a process of its own; yields its URL. boto3's
    credentials default to moto's dummies (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``) if unset."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    with tempfile.NamedTemporaryFile(prefix="consumer-kit-moto-", suffix=".log") as log:
        server = subprocess.Popen([sys.executable, "-m", "consumer_kit.testing.moto", "-H", "127.0.0.1", "-p", "0"],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while not (found := re.search(rb"Running on http://127\.0\.0\.1:(\d+)", _read(log.name))):
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = _read(log.name)[-2000:].decode(errors="replace")
                    raise RuntimeError(f"moto server did not start: {tail}")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{int(found.group(1))}"
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


WRITES = frozenset({"SendMessage", "SendMessageBatch", "DeleteMessage", "DeleteMessageBatch", "PurgeQueue"})
"""The SQS actions that add or remove a queue's messages."""


class SerialisedWrites:
    """WSGI middleware: the SQS requests in :data:`WRITES` run one at a time. The action is read from
    the JSON protocol's ``X-Amz-Target`` header (what boto3 sends), else from the query protocol's
    form body, which is then handed on unread."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if _action(environ) in WRITES:
            with self._lock:
                return list(self.app(environ, start_response))  # the whole answer made under the lock
        return self.app(environ, start_response)


def _action(environ: dict[str, Any]) -> str:
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    if target.startswith("AmazonSQS."):
        return str(target.removeprefix("AmazonSQS."))
    if environ.get("CONTENT_TYPE", "").startswith("application/x-www-form-urlencoded"):
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        return str(urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("Action", [""])[0])
    return ""


def main(argv: list[str] | None = None) -> None:
    """moto's server (as ``moto.server`` runs it, from its public parts) behind :class:`SerialisedWrites`."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(prog="python -m consumer_kit.testing.moto")
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    run_simple(args.host, args.port, SerialisedWrites(DomainDispatcherApplication(create_backend_app)),
               threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
