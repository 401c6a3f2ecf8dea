"""consumer-kit: retry-safe consumers for queues, webhooks, CloudEvents and schedules.

The public names below are imported when first used (PEP 562), not with the package: ``ConsumerApp``
brings SQLAlchemy's asyncio layer, the store and the embedded coordinator, which a command that only
prints its help, or a module that needs one error class, should not pay for at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "ConsumerApp": "consumer_kit.app",
    "Context": "consumer_kit.context",
    **dict.fromkeys(("Delivery", "KeyedSource", "Outcome", "Result", "Settlement", "Source"), "consumer_kit.delivery"),
    **dict.fromkeys(("ConfigurationError", "ConsumerKitError", "InvalidKey", "LeaseLost", "MissingStableId",
                     "RetryableError", "SchemaOutOfDate", "TerminalError", "UnparseableDelivery"),
                    "consumer_kit.errors"),
    "KeyDigester": "consumer_kit.keys",
    "OperationKey": "consumer_kit.keys",
    "Batch": "consumer_kit.pipeline",
    "Settings": "consumer_kit.settings",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'consumer_kit' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # asked once: later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
