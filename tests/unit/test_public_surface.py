"""The public names of DESIGN.md are a contract: this pins them."""

from __future__ import annotations

import consumer_kit
import consumer_kit.testing


def test_exported_members() -> None:
    assert set(consumer_kit.__all__) >= {
        "ConsumerApp", "Settings", "OperationKey", "Context", "Outcome", "Settlement",
        "InvalidKey", "MissingStableId", "RetryableError", "TerminalError",
    }
    for name in consumer_kit.__all__:
        assert getattr(consumer_kit, name).__doc__, f"{name} has no docstring"
    assert consumer_kit.testing.__all__ == [
        "Delivered", "InMemorySource", "InjectedCrash", "Proof", "RecipeHarness", "RecipeReport"]


def test_outcomes_and_settlements() -> None:
    assert {o.name for o in consumer_kit.Outcome} == {
        "PROCESSED", "DUPLICATE", "IN_PROGRESS", "CONFLICT", "INACTIVE", "INVALID", "RETRY",
        "DEAD_LETTERED", "LEASE_LOST",
    }
    assert {s.name for s in consumer_kit.Settlement} == {"ACK", "RETRY_LATER", "DEAD_LETTER"}
