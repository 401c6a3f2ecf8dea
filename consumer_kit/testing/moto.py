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
message short with the queue empty, which is moto's loss, not the consumer's. The fix: the SQS requests
that add or remove messages run one at a time (receives, long polls included, still run side by side).

moto's public server, ``moto.server.ThreadedMotoServer``, takes no WSGI middleware (it builds its
application inside its thread), and the pieces it is built from (``moto.moto_server.werkzeug_app``) are
not moto's public API. So the fix is a front of our own, in the same process: a threaded werkzeug
server (:class:`Forward` behind :class:`SerialisedWrites`) that hands each request on, over a
keep-alive loopback connection per thread, to a ``ThreadedMotoServer`` on a port of its own. The cost
is that second HTTP hop per SQS request, inside moto's process. Run as
``python -m consumer_kit.testing.moto -H HOST -p PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
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


_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                         "upgrade", "content-length", "expect"})
"""Headers that belong to one connection, not to the request or answer handed on (the length is set anew)."""


class Forward:
    """WSGI app: each request is sent on to the HTTP server at ``host:port`` and its answer returned, with
    the client's ``Host`` (moto builds queue URLs from it, so they name this front)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._local = threading.local()  # one upstream connection per request thread

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        from werkzeug.datastructures import EnvironHeaders
        from werkzeug.wsgi import get_input_stream

        target = urllib.parse.quote(environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""))
        if environ.get("QUERY_STRING"):
            target += "?" + environ["QUERY_STRING"]
        body = get_input_stream(environ).read()
        headers = {name: value for name, value in EnvironHeaders(environ).items()
                   if name.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        answer = self._send(environ["REQUEST_METHOD"], target, body, headers)
        start_response(f"{answer.status} {answer.reason}",
                       [(name, value) for name, value in answer.getheaders() if name.lower() not in _HOP_BY_HOP])
        return [answer.read()]

    def _send(self, method: str, target: str, body: bytes, headers: dict[str, str]) -> http.client.HTTPResponse:
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = http.client.HTTPConnection(self.host, self.port)
        try:
            connection.request(method, target, body, headers)
            return connection.getresponse()
        except BaseException:
            # A connection in doubt is closed, never reused; the client (boto3) retries as it would
            # against SQS, so a request is not sent twice from here.
            connection.close()
            self._local.connection = None
            raise


def main(argv: list[str] | None = None) -> None:
    """moto's public server (``ThreadedMotoServer``) behind :class:`SerialisedWrites` (see the module
    docstring); prints ``Running on http://HOST:PORT`` once it serves."""
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    parser = argparse.ArgumentParser(prog="python -m consumer_kit.testing.moto")
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=0)
    args = parser.parse_args(argv)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        front = make_server(args.host, args.port, SerialisedWrites(Forward(*moto.get_host_and_port())), threaded=True)
        print(f"Running on http://{args.host}:{front.server_port}", flush=True)
        front.serve_forever()
    finally:
        moto.stop()


if __name__ == "__main__":
    main()
