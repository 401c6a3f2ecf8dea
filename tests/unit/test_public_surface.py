"""The public names of DESIGN.md are a contract: this pins them."""

from __future__ import annotations

import inspect
import sys

import pytest

import consumer_kit
import consumer_kit.coordinator
import consumer_kit.testing


def test_exported_members() -> None:
    assert consumer_kit.__all__ == [
        "Batch", "ConfigurationError", "ConsumerApp", "ConsumerKitError", "Context", "Delivery", "InvalidKey",
        "KeyDigester", "KeyedSource", "LeaseLost", "MissingStableId", "OperationKey", "Outcome", "Result",
        "RetryableError", "SchemaOutOfDate", "Settings", "Settlement", "Source", "TerminalError",
        "UnparseableDelivery",
    ]
    assert consumer_kit.coordinator.__all__ == [
        "Coordinator", "CoordinatorRejected", "CoordinatorUnavailable", "DelegationReceipt", "DelegationRequest",
        "EmbeddedCoordinator", "HttpCoordinator", "IdempotencyKeyConflict", "IdempotencyResultInactive",
        "ReceiptLimitExceeded", "SessionReceipt", "SessionRequest", "TokenRefresher", "fingerprint",
        "generate_key",
    ]
    for module in (consumer_kit, consumer_kit.coordinator, consumer_kit.testing):
        for name in module.__all__:
            member = getattr(module, name)
            if inspect.isclass(member) or inspect.isfunction(member):  # type aliases carry no docstring
                assert member.__doc__, f"{module.__name__}.{name} has no docstring"
    assert consumer_kit.testing.__all__ == [
        "Delivered", "InMemorySource", "InjectedCrash", "Proof", "RecipeHarness", "RecipeReport"]


def test_every_public_name_is_found_where_it_is_defined() -> None:
    # consumer_kit imports each name when it is first asked for (PEP 562): each is the defining module's own.
    for name in consumer_kit.__all__:
        member = getattr(consumer_kit, name)
        assert member.__module__.startswith("consumer_kit."), (name, member.__module__)
        assert getattr(sys.modules[member.__module__], name) is member
    assert set(consumer_kit.__all__) <= set(dir(consumer_kit))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        consumer_kit.NoSuchName  # noqa: B018


def test_outcomes_and_settlements() -> None:
    assert {o.name for o in consumer_kit.Outcome} == {
        "PROCESSED", "DUPLICATE", "IN_PROGRESS", "CONFLICT", "INACTIVE", "INVALID", "RETRY",
        "DEAD_LETTERED", "LEASE_LOST",
    }
    assert {s.name for s in consumer_kit.Settlement} == {"ACK", "RETRY_LATER", "DEAD_LETTER"}


class _NoVersion:
    name = "broken"
    namespace = "orders"

    def key(self, delivery: object) -> None: ...


@pytest.mark.parametrize(("source", "said"), [
    (object(), "a non-empty str 'name'"),
    (_NoVersion(), "an int 'version'"),
    (_NoVersion(), "the methods start, stop, close"),
])
def test_an_object_that_is_no_source_is_refused_at_registration(source: object, said: str) -> None:
    app = consumer_kit.ConsumerApp(consumer_kit.Settings(database_url="sqlite+aiosqlite:///:memory:"))
    with pytest.raises(consumer_kit.ConfigurationError, match="is not a source") as refused:
        app.handler(source)  # type: ignore[arg-type]
    assert said in str(refused.value)


def test_a_source_with_an_invalid_namespace_is_refused() -> None:
    source = consumer_kit.testing.InMemorySource(namespace="orders", version=1)
    source.namespace = "bad:namespace"
    app = consumer_kit.ConsumerApp(consumer_kit.Settings(database_url="sqlite+aiosqlite:///:memory:"))
    with pytest.raises(consumer_kit.ConfigurationError, match="valid namespace"):
        app.handler(source)
