"""Helpers for tests: a source with no broker."""

from consumer_kit.testing.source import InMemorySource

__all__ = ["InMemorySource"]
