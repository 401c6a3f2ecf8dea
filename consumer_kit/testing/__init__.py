"""Helpers for tests: a source with no broker, and a harness that proves the retry-safety recipe for a
user's own handler (replay, conflict, inactive, effect once). The pytest plugin
(``consumer_kit.testing.plugin``) adds fixtures."""

from consumer_kit.testing.harness import Delivered, InjectedCrash, Proof, RecipeHarness, RecipeReport
from consumer_kit.testing.source import InMemorySource

__all__ = ["Delivered", "InMemorySource", "InjectedCrash", "Proof", "RecipeHarness", "RecipeReport"]
