"""boto3's SQS client on a thread pool of its own, and the batching of SQS's batch actions.

Why boto3 in threads and not aiobotocore: aiobotocore re-implements parts of botocore's internals,
so each release pins botocore to a patch range (``botocore>=1.20.49,<1.20.50``, aio-libs/aiobotocore
#862); installed next to the boto3 that an application already uses, it decides that application's
botocore version, and a boto3 upgrade waits for aiobotocore. The source makes few blocking calls (a
long poll per poller, and batched settlements), so a small pool of threads costs little: boto3
clients are thread-safe, and the pool is the source's own, never the loop's default executor, so a
20-second long poll can never starve ``asyncio.to_thread`` users elsewhere in the application.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

log = logging.getLogger("consumer_kit.sources.sqs")

BATCH_MAX = 10  # entries per SQS batch action
# SendMessageBatch's total payload: AWS allows 1 MiB since 2025, but 256 KiB is what every SQS
# (LocalStack, older regions, ElasticMQ) accepts; a larger message is simply sent in a call of its own.
BATCH_MAX_BYTES = 262_144
MAX_VISIBILITY_SECONDS = 43_200  # SQS: 12 hours


class SqsEntryFailed(Exception):
    """One entry of an SQS batch action failed; ``code`` is SQS's error code."""

    def __init__(self, code: str, message: str = "", *, sender_fault: bool = True) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.sender_fault = sender_fault


def error_code(exc: BaseException) -> str:
    """SQS's error code for a ``ClientError`` or a failed batch entry, else the exception's type name."""
    if isinstance(exc, SqsEntryFailed):
        return exc.code
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code") or type(exc).__name__)
    return type(exc).__name__


def explain(exc: BaseException, endpoint: str | None) -> str:
    """What to do about an error that stops a source or publisher from starting."""
    where = endpoint or "AWS"
    if isinstance(exc, botocore.exceptions.NoRegionError):
        return "no AWS region: set SQS_REGION (or AWS_REGION / AWS_DEFAULT_REGION)"
    if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
        return ("no AWS credentials: boto3 looks in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                "and ~/.aws, then the container or instance role")
    if isinstance(exc, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectTimeoutError):
        return f"cannot reach the SQS endpoint {where} ({type(exc).__name__}); check SQS_ENDPOINT_URL"
    code = error_code(exc)
    if code in ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"):
        return f"the queue does not exist at {where}"
    return f"SQS at {where} answered {code}"


class SqsClient:
    """A boto3 SQS client whose calls run on a dedicated pool of ``threads`` threads.

    ``read_timeout`` must exceed the long poll (``WaitTimeSeconds``), or every quiet poll would end
    in a timeout; botocore's connection pool holds one connection per thread.
    """

    def __init__(self, *, endpoint_url: str | None, region: str | None, threads: int, read_timeout: float,
                 name: str) -> None:
        self.endpoint_url = endpoint_url
        self.region = region
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"consumer-kit-{name}")
        self._config = Config(
            max_pool_connections=threads, connect_timeout=5, read_timeout=read_timeout,
            retries={"mode": "standard", "max_attempts": 3}, user_agent_extra="consumer-kit",
        )
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 client, for calls already running on one of the pool's threads."""
        if self._client is None:
            raise RuntimeError("the SQS client is not open")
        return self._client

    async def open(self) -> None:
        """Create the client (reading credentials and region through boto3's usual chain)."""
        if self._client is None:
            self._client = await self.run(self._make)

    def _make(self) -> Any:
        session = boto3.session.Session(region_name=self.region)
        return session.client("sqs", endpoint_url=self.endpoint_url, config=self._config)

    async def run(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on one of the pool's threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args, **kwargs))

    async def call(self, operation: str, **params: Any) -> dict[str, Any]:
        """One SQS API call (``operation`` is the boto3 method name) on the pool."""
        result: dict[str, Any] = await self.run(getattr(self.client, operation), **params)
        return result

    async def close(self, *, wait: bool = True) -> None:
        """Close the client's connections and the pool; ``wait=False`` leaves threads still inside a
        call (a long poll) to finish on their own."""
        client, self._client = self._client, None
        if client is not None and wait:
            with contextlib.suppress(Exception):
                await self.run(client.close)
        self._pool.shutdown(wait=False, cancel_futures=not wait)


class _Entry:
    __slots__ = ("build", "future", "tries")

    def __init__(self, build: Callable[[], dict[str, Any]], future: asyncio.Future[dict[str, Any]]) -> None:
        self.build = build
        self.future = future
        self.tries = 0


class BatchAction:
    """One SQS batch action (``delete_message_batch``, ``change_message_visibility_batch``,
    ``send_message_batch``) on one queue: entries collect until there are ten (or their bytes reach
    the request limit), ``linger`` seconds pass or the owner calls :meth:`flush`, then go out in one
    call.

    Entry ids are positions in the batch, never message ids: one receive can return the same message
    twice, and two entries with one id fail the whole call (``BatchEntryIdsNotDistinct``). Each entry
    is built when it is sent (``build`` is called then), so a delete or visibility change uses the
    newest receipt handle even if the message was received again meanwhile. Entries that fail on
    SQS's side, and calls that fail outright, are sent again up to ``attempts`` times.
    ``ordered=True`` (sends to a FIFO queue) makes one call at a time, in the order entries were put,
    since two calls in flight can reach SQS in either order; a retried entry goes after them.
    """

    def __init__(self, client: SqsClient, operation: str, queue_url: str, *, linger: float,
                 attempts: int = 3, size: Callable[[dict[str, Any]], int] | None = None,
                 ordered: bool = False) -> None:
        self.client = client
        self.operation = operation
        self.queue_url = queue_url
        self.linger = linger
        self.attempts = attempts
        self._size = size
        self._pending: list[_Entry] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._one_at_a_time = asyncio.Lock() if ordered else None

    def put(self, build: Callable[[], dict[str, Any]]) -> asyncio.Future[dict[str, Any]]:
        """Queue one entry (``build()`` makes it, without ``Id``); the future holds SQS's answer for it
        or :class:`SqsEntryFailed`. Awaiting it is optional: the entry is sent either way."""
        loop = asyncio.get_running_loop()
        entry = _Entry(build, loop.create_future())
        entry.future.add_done_callback(_consume)
        self._pending.append(entry)
        if len(self._pending) >= BATCH_MAX:
            self.flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger, self.flush)
        return entry.future

    def flush(self) -> None:
        """Send what is queued now, ten entries a call."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch, self._pending = self._pending[:BATCH_MAX], self._pending[BATCH_MAX:]
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Entry]) -> None:
        entries: list[tuple[_Entry, dict[str, Any]]] = [(e, e.build()) for e in batch]
        if self._size is not None:
            chunks: list[list[tuple[_Entry, dict[str, Any]]]] = [[]]
            total = 0
            for pair in entries:
                size = self._size(pair[1])
                if chunks[-1] and total + size > BATCH_MAX_BYTES:
                    chunks.append([])
                    total = 0
                chunks[-1].append(pair)
                total += size
        else:
            chunks = [entries]
        await asyncio.gather(*(self._call(chunk) for chunk in chunks))

    async def _call(self, chunk: list[tuple[_Entry, dict[str, Any]]]) -> None:
        for entry, _ in chunk:
            entry.tries += 1
        try:
            async with self._one_at_a_time or contextlib.nullcontext():
                response = await self.client.call(
                    self.operation, QueueUrl=self.queue_url,
                    Entries=[dict(body, Id=str(i)) for i, (_, body) in enumerate(chunk)])
        except Exception as exc:
            code = error_code(exc)
            again = [entry for entry, _ in chunk if entry.tries < self.attempts]
            for entry, _ in chunk:
                if entry.tries >= self.attempts and not entry.future.done():
                    entry.future.set_exception(SqsEntryFailed(code, sender_fault=False))
            if again:
                log.warning("SQS %s failed (%s); trying %d entries again", self.operation, code, len(again))
                await asyncio.sleep(random.uniform(0.2, 0.5) * 2 ** again[0].tries)
                self._requeue(again)
            return
        for ok in response.get("Successful", []):
            entry = chunk[int(ok["Id"])][0]
            if not entry.future.done():
                entry.future.set_result(ok)
        retry: list[_Entry] = []
        for failed in response.get("Failed", []):
            entry = chunk[int(failed["Id"])][0]
            sender_fault = bool(failed.get("SenderFault"))
            if not sender_fault and entry.tries < self.attempts:
                retry.append(entry)
            elif not entry.future.done():
                entry.future.set_exception(SqsEntryFailed(
                    str(failed.get("Code")), str(failed.get("Message", "")), sender_fault=sender_fault))
        if retry:
            self._requeue(retry)

    def _requeue(self, entries: list[_Entry]) -> None:
        self._pending[:0] = entries
        self.flush()

    async def drain(self, seconds: float) -> None:
        """Send what is queued now and wait (up to ``seconds``) for every call under way."""
        self.flush()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=seconds)


def _consume(future: asyncio.Future[Any]) -> None:
    # Nobody may be awaiting the entry (a release at shutdown): mark its error as seen, so asyncio
    # does not report it as "never retrieved"; the callers that care await the future and see it.
    if not future.cancelled():
        future.exception()
