"""``python -m examples init``: every example's ``init`` in one process, as docker-compose.yml's
``example-setup`` job runs it: the examples' own tables, and the RabbitMQ queues, NATS events stream, SQS queues and SNS
topic they use (each ``init`` is idempotent). consumer-kit's own tables come from ``consumer-kit db upgrade``.
"""

from __future__ import annotations

import asyncio
import importlib
import sys

from consumer_kit import ConfigurationError

EXAMPLES = ("examples.rabbitmq_worker", "examples.sqs_worker", "examples.nats_worker", "examples.redis_worker",
            "examples.starter", "examples.nightly_report", "examples.idempotent_api")
"""The examples whose ``init`` runs, in this order."""


async def init_all() -> None:
    """Run each example's ``init``."""
    for name in EXAMPLES:
        await importlib.import_module(name).init()
        print(f"{name}: initialised", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["init"]:
        raise SystemExit("usage: python -m examples init")
    try:
        asyncio.run(init_all())
    except ConfigurationError as exc:  # one line that says what to set, as each example's own init gives
        print(f"python -m examples init: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
