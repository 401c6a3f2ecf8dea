"""The transport the bounding gate hands uvicorn's protocol (consumer_kit/http/server.py): a response's
head goes out with its body in one write, nothing is held past the loop's next turn, a close sends what
is held and an abort drops it. The served paths run in tests/acceptance/test_server_bounds.py and the
coordinator's integration tests; here the writes are counted on a real socket pair."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from consumer_kit.http.server import _Coalescing


class _Counting(asyncio.Protocol):
    """A protocol that does nothing with what it receives: the tests read the socket's other end."""


async def _pair() -> tuple[asyncio.Transport, socket.socket, list[bytes]]:
    """A real loopback transport whose writes are recorded, and the peer's socket."""
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(_Counting, sock=ours)
    writes: list[bytes] = []
    real_write = transport.write

    def write(data: Any) -> None:
        writes.append(bytes(data))
        real_write(data)

    transport.write = write  # type: ignore[method-assign]
    theirs.setblocking(False)
    return transport, theirs, writes


async def _received(peer: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        data += await asyncio.wait_for(loop.sock_recv(peer, size - len(data)), 2)
    return data


async def test_head_and_body_go_out_in_one_write() -> None:
    transport, peer, writes = await _pair()
    out = _Coalescing(transport, asyncio.get_running_loop())
    out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert writes == [] and out.get_write_buffer_size() > 0
    out.write(b"{}")
    assert writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    assert await _received(peer, len(writes[0])) == writes[0]
    out.close()
    peer.close()


async def test_a_lone_write_goes_out_on_the_next_turn() -> None:
    transport, peer, writes = await _pair()
    out = _Coalescing(transport, asyncio.get_running_loop())
    out.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    assert await _received(peer, 25) == b"HTTP/1.1 100 Continue\r\n\r\n"
    out.close()
    peer.close()


async def test_large_writes_are_not_held_and_order_is_kept() -> None:
    transport, peer, writes = await _pair()
    out = _Coalescing(transport, asyncio.get_running_loop())
    big = b"x" * (_Coalescing.HOLD_BYTES + 1)
    out.write(big)
    assert writes == [big]
    out.write(b"a")
    out.write(b"b")
    out.write(b"c")  # nothing held: the next small write is held again
    assert writes == [big, b"ab"]
    out.close()  # sends what is held before closing
    assert writes == [big, b"ab", b"c"]
    assert await _received(peer, len(big) + 3) == big + b"abc"
    peer.close()


async def test_abort_drops_what_is_held() -> None:
    transport, peer, writes = await _pair()
    out = _Coalescing(transport, asyncio.get_running_loop())
    out.write(b"held")
    out.abort()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert writes == []
    assert out.is_closing()
    peer.close()


async def test_nothing_is_held_on_a_closing_transport() -> None:
    transport, peer, _writes = await _pair()
    out = _Coalescing(transport, asyncio.get_running_loop())
    transport.close()
    out.write(b"late")
    out.flush()
    assert out.get_write_buffer_size() == 0
    peer.close()
