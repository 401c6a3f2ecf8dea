"""Fingerprints, retry classification and budgets, token parsing, the public coordinator names,
and the pytest plugin's fixtures as a user's suite would use them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, func, select

import consumer_kit.coordinator as coordinator_package
from consumer_kit import ConfigurationError, ConsumerApp, Context, RetryableError, Settings, TerminalError
from consumer_kit.coordinator import (
    CoordinatorRejected,
    CoordinatorUnavailable,
    EmbeddedCoordinator,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    ReceiptLimitExceeded,
    SessionRequest,
    fingerprint,
    generate_key,
)
from consumer_kit.retry import RetryBudget, RetryPolicy, is_retryable_status, parse_retry_after
from consumer_kit.testing import InMemorySource, RecipeHarness


def test_public_names() -> None:
    for name in ("Coordinator", "HttpCoordinator", "EmbeddedCoordinator", "SessionRequest", "SessionReceipt",
                 "DelegationRequest", "DelegationReceipt", "IdempotencyKeyConflict", "IdempotencyResultInactive",
                 "ReceiptLimitExceeded", "CoordinatorUnavailable", "CoordinatorRejected"):
        assert name in coordinator_package.__all__ and hasattr(coordinator_package, name)


def test_error_tree() -> None:
    assert issubclass(CoordinatorUnavailable, RetryableError) and issubclass(ReceiptLimitExceeded, RetryableError)
    assert issubclass(IdempotencyKeyConflict, CoordinatorRejected)
    assert issubclass(IdempotencyResultInactive, CoordinatorRejected)
    assert issubclass(CoordinatorRejected, TerminalError)
    assert (IdempotencyKeyConflict().code, IdempotencyKeyConflict().reason) == ("idempotency_key_conflict", "conflict")
    assert (IdempotencyResultInactive().code, IdempotencyResultInactive().reason) == (
        "idempotency_result_inactive", "inactive")


def test_fingerprint_is_canonical() -> None:
    a = SessionRequest(labels=("x", "y"), scopes=("r", "w"), metadata={"b": {"d": 1, "c": 2}, "a": 1})
    b = SessionRequest(labels=("y", "x", "x"), scopes=("w", "r"), metadata={"a": 1, "b": {"c": 2, "d": 1}})
    assert fingerprint("session", a) == fingerprint("session", b)
    assert fingerprint("session", a) != fingerprint("session", a.model_copy(update={"metadata": {"a": 2}}))
    with pytest.raises(ValueError):
        SessionRequest.model_validate({"task": "t", "unknown_field": 1})  # unknown fields are refused


def test_generated_keys_have_128_bits() -> None:
    keys = {generate_key() for _ in range(100)}
    assert len(keys) == 100 and all(len(k) == 22 for k in keys)


def test_retry_classification() -> None:
    assert all(is_retryable_status(s) for s in (408, 425, 429, 500, 502, 503, 504))
    assert not any(is_retryable_status(s) for s in (400, 401, 403, 404, 409, 413, 422))


def test_retry_after_parsing() -> None:
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Sun, 29 Nov 2026 12:00:05 GMT", now=now) == 5.0
    assert parse_retry_after("Sun, 29 Nov 2026 11:00:00 GMT", now=now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_budget_counts_attempts_and_time() -> None:
    clock = [0.0]
    budget = RetryBudget(RetryPolicy(attempts=3, total_seconds=10, base_backoff=1, max_backoff=4),
                         clock=lambda: clock[0], rand=lambda low, high: high)
    assert budget.next_delay() == 1.0
    assert budget.next_delay(retry_after=3.0) == 3.0  # Retry-After beats a shorter backoff
    assert budget.next_delay() is None  # three attempts made
    timed = RetryBudget(RetryPolicy(attempts=10, total_seconds=5), clock=lambda: clock[0])
    assert timed.next_delay(retry_after=6.0) is None  # would overrun the deadline
    clock[0] = 5.0
    assert timed.next_delay() is None


def test_coordinator_tokens_setting() -> None:
    settings = Settings(coordinator_tokens='{"tok": "acme/tickets"}')  # type: ignore[arg-type]
    assert settings.coordinator_scopes() == {"tok": ("acme", "tickets")}
    for bad in ('["s3cr3t"]', '{"s3cr3t": "no-application"}', "not json s3cr3t"):
        with pytest.raises(ConfigurationError) as caught:
            Settings(coordinator_tokens=bad).coordinator_scopes()  # type: ignore[arg-type]
        assert "s3cr3t" not in str(caught.value)


def test_single_transaction_handlers_cannot_have_sessions(consumer_kit_app: ConsumerApp) -> None:
    with pytest.raises(ConfigurationError):
        @consumer_kit_app.handler(InMemorySource(namespace="n", version=1), single_transaction=True, task="t")
        async def handle(ctx: Context) -> None:
            pass


rows = Table("plugin_rows", MetaData(), Column("id", Integer, primary_key=True, autoincrement=True))


async def test_plugin_fixtures_run_the_recipe(consumer_kit_app: ConsumerApp,
                                              consumer_kit_source: InMemorySource) -> None:
    @consumer_kit_app.handler(consumer_kit_source, labels=["agent"], task="Do the thing")
    async def handle(ctx: Context) -> None:
        await ctx.db.execute(rows.insert())

    async def count() -> int:
        async with consumer_kit_app.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(rows))).scalar_one())

    async with consumer_kit_app.running():
        async with consumer_kit_app.engine.begin() as conn:
            await conn.run_sync(rows.metadata.create_all)
        harness = RecipeHarness(consumer_kit_app, consumer_kit_source, effects=count)
        (await harness.run(body=b"{}", changed_body=b'{"changed": true}')).assert_ok()


async def test_embedded_coordinator_fixture(embedded_coordinator: EmbeddedCoordinator) -> None:
    async with embedded_coordinator.session(idempotency_key="k:plugin", task="t") as receipt:
        assert receipt.status == "active"
