"""Shared fixtures: a fresh PostgreSQL database per test run, a SQLite file per test, and the guard
that no raw idempotency key reaches a log record, a metric sample or a span anywhere in the suite."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from sqlalchemy import text

from consumer_kit import Settings
from consumer_kit.keys import OperationKey
from consumer_kit.store import create_engine, metadata, upgrade
from consumer_kit.testing.moto import moto_server

PG_ADMIN_URL = os.environ.get("CK_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
TEST_HMAC_KEY = "test-hmac-key-0123456789abcdef"

# ---------------------------------------------------------------------------------------------------
# The slow kinds of test run first (chaos runs of a minute or more, then the acceptance tests that start
# processes, the docs pages, the integration tests), so that ``make test``'s workers (xdist's worksteal
# schedule: an idle worker takes over the pending tests of a busy one) are not left waiting on one long
# test at the end of the run. The order within a kind is kept.

_SLOW_FIRST = ("tests/chaos/", "tests/acceptance/", "tests/docs/", "tests/integration/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def kind(item: pytest.Item) -> int:
        return next((rank for rank, prefix in enumerate(_SLOW_FIRST) if item.nodeid.startswith(prefix)),
                    len(_SLOW_FIRST))

    items.sort(key=kind)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Delete the RabbitMQ queues the session's tests left for its end (tests.integration.rabbit)."""
    import sys

    rabbit = sys.modules.get("tests.integration.rabbit")
    if rabbit is not None:
        rabbit.delete_left_queues()


# ---------------------------------------------------------------------------------------------------
# Raw keys must never be logged or used as metric labels: every key the suite builds is remembered,
# every log record is captured, and after each test both are checked.

_RAW_KEYS: set[str] = set()
_original_post_init = OperationKey.__post_init__


def _remembering_post_init(self: OperationKey) -> None:
    _original_post_init(self)
    _RAW_KEYS.add(str(self))


OperationKey.__post_init__ = _remembering_post_init  # type: ignore[method-assign]
_original_derive = OperationKey.derive


def _remembering_derive(self: OperationKey, prefix: str) -> str:
    derived = _original_derive(self, prefix)
    _RAW_KEYS.add(derived)
    return derived


OperationKey.derive = _remembering_derive  # type: ignore[method-assign]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        parts = [record.getMessage(), repr(record.__dict__.get("key_digest", ""))]
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(logging.Formatter().formatException(record.exc_info))
        self.texts.append("\n".join(parts))


def raw_keys_in(texts: list[str]) -> list[str]:
    """The remembered raw keys that occur in any of ``texts``."""
    keys = [k for k in _RAW_KEYS if len(k) > 8]
    # One search per key over all texts joined: a key cannot span two texts, since keys hold no
    # control character. (Per text and key, a 10,000-message test took longer to check than to run.)
    joined = "\n".join(texts)
    return sorted({k for k in keys if k in joined})


# Every app the suite starts traces its deliveries (OpenTelemetry's SDK, spans kept in memory), so
# that the guard reads every span name, attribute, event and link of the suite too.
SPANS = InMemorySpanExporter()
_SUITE_TRACER_PROVIDER = TracerProvider()
_SUITE_TRACER_PROVIDER.add_span_processor(SimpleSpanProcessor(SPANS))
trace.set_tracer_provider(_SUITE_TRACER_PROVIDER)


_KEYISH = re.compile(r":v\d+:")


def span_texts(spans: Sequence[ReadableSpan]) -> list[str]:
    """Everything a span shows an operator: its name, status, and every attribute value of the span,
    its events and its links."""
    texts: list[str] = []
    for span in spans:
        texts.append(span.name)
        texts.append(span.status.description or "")
        attribute_sets = [span.attributes, *(e.attributes for e in span.events),
                          *(link.attributes for link in span.links)]
        for attributes in attribute_sets:
            texts.extend(str(value) for value in (attributes or {}).values())
        texts.extend(e.name for e in span.events)
    return texts


class Spans:
    """A tracer provider of a test's own (what it records also goes to the suite's raw-key guard)."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(SimpleSpanProcessor(SPANS))

    @property
    def finished(self) -> Sequence[ReadableSpan]:
        return self.exporter.get_finished_spans()

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.finished if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, [s.name for s in self.finished]
        return found[0]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        return [s for s in self.finished if s.parent is not None and s.parent.span_id == parent.context.span_id]


@pytest.fixture
def spans() -> Iterator[Spans]:
    recorded = Spans()
    yield recorded
    recorded.provider.shutdown()


def hex_span(span: ReadableSpan) -> tuple[str, str]:
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


def metric_label_values() -> list[str]:
    return [value for family in REGISTRY.collect() for sample in family.samples
            for value in sample.labels.values()]


@pytest.fixture(autouse=True)
def no_raw_keys_in_logs_or_metrics() -> Iterator[_Capture]:
    capture = _Capture()
    root = logging.getLogger()
    ck_logger = logging.getLogger("consumer_kit")
    old_level = ck_logger.level
    ck_logger.setLevel(logging.DEBUG)
    root.addHandler(capture)
    try:
        yield capture
    finally:
        root.removeHandler(capture)
        ck_logger.setLevel(old_level)
    leaked = raw_keys_in(capture.texts)
    assert not leaked, f"raw idempotency keys in log records: {len(leaked)}"
    leaked = raw_keys_in(metric_label_values())
    assert not leaked, f"raw idempotency keys in metric labels: {len(leaked)}"
    spans = SPANS.get_finished_spans()
    SPANS.clear()
    # Only texts that could hold a key ("<namespace>:v<version>:<id>") are searched: a test's spans say
    # far more than its log records do.
    leaked = raw_keys_in([text for text in span_texts(spans) if _KEYISH.search(text)])
    assert not leaked, f"raw idempotency keys in spans: {len(leaked)}"


# ---------------------------------------------------------------------------------------------------
# Databases


async def _admin(statement: str) -> None:
    engine = create_engine(PG_ADMIN_URL.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(text(statement))
    finally:
        await engine.dispose()


def run_in_thread(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine to completion on a loop of its own (session fixtures may be set up while a
    test's loop is running)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()


@contextlib.contextmanager
def migrated_database(prefix: str) -> Iterator[str]:
    """A PostgreSQL database of its own (``<prefix>_<random>``), migrated to head, dropped on leaving;
    its asyncpg URL."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    run_in_thread(_admin(f'CREATE DATABASE "{name}"'))
    url = (PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}").replace("postgresql://", "postgresql+asyncpg://")

    async def migrate() -> None:
        engine = create_engine(url)
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()

    try:
        run_in_thread(migrate())
        yield url
    finally:
        run_in_thread(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database created for this test run, migrated to head, dropped afterwards."""
    with migrated_database("ck_test") as url:
        yield url


async def truncate_all(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            names = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
            await conn.execute(text(f"TRUNCATE {names}"))
    finally:
        await engine.dispose()


@pytest.fixture
async def pg_database(pg_url: str) -> AsyncIterator[str]:
    """The run's PostgreSQL database, emptied before the test."""
    await truncate_all(pg_url)
    yield pg_url


@pytest.fixture(scope="session")
def pgbouncer_port(pg_url: str) -> Iterator[int]:
    """A PgBouncer in transaction pool mode in front of the test server, for this run (:mod:`tests.pgbouncer`);
    its port. Skipped only where ``pgbouncer`` is not installed."""
    from tests import pgbouncer

    if pgbouncer.executable() is None:
        pytest.skip(pgbouncer.MISSING)
    with pgbouncer.pgbouncer(pg_url) as port:
        yield port


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file of the test's own."""
    return f"sqlite+aiosqlite:///{tmp_path}/consumer-kit.db"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("psycopg", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each test that takes it runs three times: on a SQLite file, and on the real PostgreSQL server
    through asyncpg (the store's asyncpg executor) and through psycopg (its SQLAlchemy executor)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/consumer-kit.db"
    else:
        url = request.getfixturevalue("pg_url")
        await truncate_all(url)
        yield url if request.param == "postgres" else url.replace("+asyncpg://", "+psycopg://")


def make_settings(database_url: str, **overrides: object) -> Settings:
    """Settings for a test: the given database, the test HMAC key, fast retries."""
    values: dict[str, object] = {
        "database_url": database_url,
        "idempotency_hmac_key": TEST_HMAC_KEY,
        "retry_backoff_seconds": 0.001,
        "retry_backoff_max_seconds": 0.01,
        "sweep_interval_seconds": 3600,
        "shutdown_grace_seconds": 5,
        "db_pool_size": 4,  # several apps share the server's 100 connections with other test runs
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def settings(database_url: str) -> Settings:
    """Settings on the parametrised database."""
    return make_settings(database_url)


# ---------------------------------------------------------------------------------------------------
# SQS (and SNS, EventBridge, S3): moto's server over HTTP


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto server on a free loopback port for this run (:func:`consumer_kit.testing.moto.moto_server`:
    a process of its own, with moto's lost-message race fixed); yields its URL, with boto3's
    credentials set to moto's dummies."""
    patch = pytest.MonkeyPatch()
    patch.setenv("AWS_ACCESS_KEY_ID", "testing")
    patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    patch.delenv("AWS_PROFILE", raising=False)
    try:
        with moto_server() as endpoint:
            yield endpoint
    finally:
        patch.undo()
