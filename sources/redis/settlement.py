"""The Redis Streams settlement policy: the retry delay (:func:`retry_delay`), and the claims a
consumer makes on entries it believes it holds (:class:`Claims`).

Redis's ``XCLAIM`` moves an entry to the claiming consumer from whoever holds it, as long as it has
been idle for the given time; it never asks who that was. A heartbeat ``XCLAIM ... 0 ... JUSTID`` would
therefore take back an entry that another consumer already took over (ours had gone quiet past
``claim_idle_seconds``, and the other one is running it now): two runs, where one was enough. So every
claim here goes through one small Lua script that claims only the ids still in THIS consumer's pending
list, atomically (the server runs a script with nothing in between), and says which ones those were:
the heartbeat (``JUSTID``: idle time reset, delivery count unchanged), a retry's return (a plain
``XCLAIM``: the entry again, delivery count + 1) and a give-back (``IDLE``: idle as if for
``claim_idle_seconds``, so another replica's ``XAUTOCLAIM`` takes it at its next scan).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio

from consumer_kit.sources.redis.message import Fields

_CLAIM_IF_OURS = """
local ours = {}
for i = 4, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    ours[#ours + 1] = ARGV[i]
  end
end
if #ours == 0 then return {} end
local call = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for _, id in ipairs(ours) do call[#call + 1] = id end
if ARGV[3] == 'take' then return redis.call(unpack(call)) end
if ARGV[3] ~= 'beat' then
  call[#call + 1] = 'IDLE'
  call[#call + 1] = ARGV[3]
end
call[#call + 1] = 'JUSTID'
return redis.call(unpack(call))
"""

_FORGET_IF_IDLE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""

_CHUNK = 500  # ids a script call: Lua's unpack() has a limit of a few thousand values


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Claims:
    """Claims on ``stream``'s entries for ``consumer`` of ``group``, only on those it still holds (see
    the module docstring)."""

    def __init__(self, client: redis.asyncio.Redis, stream: str, group: str, consumer: str) -> None:
        self._stream, self._group, self._consumer = stream, group, consumer
        self._claim = client.register_script(_CLAIM_IF_OURS)
        self._forget = client.register_script(_FORGET_IF_IDLE)

    async def _run(self, mode: str, ids: Sequence[str]) -> list[object]:
        replies: list[object] = []
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start:start + _CHUNK]
            reply = await self._claim(keys=[self._stream], args=[self._group, self._consumer, mode, *chunk])
            replies.extend(reply or [])
        return replies

    async def beat(self, ids: Sequence[str]) -> set[str]:
        """Reset the idle time of those of ``ids`` this consumer still holds; returns those."""
        return {_text(i) for i in await self._run("beat", ids)}

    async def give_back(self, ids: Sequence[str], idle_ms: int) -> set[str]:
        """Mark those of ``ids`` this consumer still holds as idle for ``idle_ms`` (claimable at once
        by another consumer's ``XAUTOCLAIM`` with that idle time); returns those."""
        return {_text(i) for i in await self._run(str(max(idle_ms, 1)), ids)}

    async def take(self, ids: Sequence[str]) -> list[tuple[str, Fields]]:
        """Claim those of ``ids`` this consumer still holds again, as a new delivery (delivery count + 1):
        their ids and fields. An entry trimmed from the stream meanwhile is dropped from the pending
        list by ``XCLAIM`` itself, and is not among them."""
        taken: list[tuple[str, Fields]] = []
        for item in await self._run("take", ids):
            if not isinstance(item, list | tuple) or len(item) != 2 or not item[1]:
                continue
            flat = list(item[1])
            taken.append((_text(item[0]), {bytes(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}))
        return taken

    async def forget_consumer_if_idle(self) -> bool:
        """Delete this consumer from the group if it holds no pending entry (atomically: nothing can be
        lost with it); it leaves the group's consumer list tidy. Returns whether it was deleted."""
        reply = await self._forget(keys=[self._stream], args=[self._group, self._consumer])
        return isinstance(reply, int) and reply >= 0
