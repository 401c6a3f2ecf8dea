"""consumer-kit: retry-safe consumers for queues, webhooks, CloudEvents and schedules."""

from consumer_kit.app import ConsumerApp
from consumer_kit.context import Context
from consumer_kit.delivery import Delivery, KeyedSource, Outcome, Result, Settlement, Source
from consumer_kit.errors import (
    ConfigurationError,
    ConsumerKitError,
    InvalidKey,
    LeaseLost,
    MissingStableId,
    RetryableError,
    SchemaOutOfDate,
    TerminalError,
    UnparseableDelivery,
)
from consumer_kit.keys import KeyDigester, OperationKey
from consumer_kit.pipeline import Batch
from consumer_kit.settings import Settings

__all__ = [
    "Batch",
    "ConfigurationError",
    "ConsumerApp",
    "ConsumerKitError",
    "Context",
    "Delivery",
    "InvalidKey",
    "KeyDigester",
    "KeyedSource",
    "LeaseLost",
    "MissingStableId",
    "OperationKey",
    "Outcome",
    "Result",
    "RetryableError",
    "SchemaOutOfDate",
    "Settings",
    "Settlement",
    "Source",
    "TerminalError",
    "UnparseableDelivery",
]
