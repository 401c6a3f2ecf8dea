"""Shared benchmark plumbing: a throw-away PostgreSQL database and a fixed-concurrency driver."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import asyncpg

PG_ADMIN = os.environ.get("CK_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

T = TypeVar("T")


@contextlib.asynccontextmanager
async def scratch_database() -> AsyncIterator[str]:
    """A new PostgreSQL database for one benchmark run; yields its plain URL and drops it after."""
    name = f"ck_bench_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        admin = await asyncpg.connect(PG_ADMIN)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def drive(items: Sequence[T], work: Callable[[T], Awaitable[object]], concurrency: int) -> float:
    """Run ``work`` over ``items`` with ``concurrency`` workers; return items per second."""
    queue: asyncio.Queue[T] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def worker() -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await work(item)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(items) / (time.perf_counter() - started)


def verdict(ratio: float, target: float) -> str:
    """``ok`` or ``BELOW TARGET``, for a ratio against its target."""
    return "ok" if ratio >= target else "BELOW TARGET"
