"""The CloudEvents sink under a real uvicorn server on a loopback port, spoken to over one keep-alive
connection: hostile JSON is answered 400 without a traceback, and the connection stays usable."""

from __future__ import annotations

import logging

import httpx
import pytest

from consumer_kit.testing.server import served_asgi
from tests.integration.cloudevents_sink import BATCH, STRUCTURED, TOKEN, Sink

DEEP = b"[" * 1000 + b"]" * 1000  # about 1,000 levels in 2 KB
EVENT = b'{"specversion": "1.0", "type": "t", "source": "/s", "id": "%s", "data": %s}'


def local_port(answer: httpx.Response) -> int:
    """The client side port of the connection that carried ``answer``."""
    return int(answer.extensions["network_stream"].get_extra_info("client_addr")[1])


async def test_deeply_nested_json_is_a_400_and_the_connection_lives_on(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = Sink(database_url)
    hostile = [
        (DEEP, STRUCTURED),
        (EVENT % (b"deep-data", DEEP), STRUCTURED),
        (DEEP, {"content-type": "application/json", "ce-specversion": "1.0", "ce-type": "t",
                "ce-source": "/s", "ce-id": "deep-binary"}),
        (b"[" + DEEP + b"]", BATCH),
    ]
    caplog.set_level(logging.INFO)
    async with served_asgi(sink.app.asgi()) as base:
        async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {TOKEN}"}) as client:
            answers = [await client.post("/events", content=body, headers=headers) for body, headers in hostile]
            fine = await client.post("/events", content=EVENT % (b"fine", b'{"n": 1}'), headers=STRUCTURED)
            ports = {local_port(a) for a in [*answers, fine]}
    assert [a.status_code for a in answers] == [400, 400, 400, 400]
    assert {a.json()["reason"] for a in answers} == {"unparseable"}
    assert (fine.status_code, fine.json()["outcome"]) == (200, "processed")
    assert len(ports) == 1  # one keep-alive connection throughout
    assert [d.headers["ce-id"] for d in sink.seen] == ["fine"]
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]
    async with sink.app.running():
        assert await sink.app.dead_letters.count(reason="unparseable") == len(hostile)
