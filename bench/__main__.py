"""``python -m bench [name ...]``: run the benchmarks (all by default) and print their ratios."""

from __future__ import annotations

import importlib
import sys

from consumer_kit.cli import run_async

BENCHMARKS = {
    "pipeline": "bench.pipeline",
    "coordinator": "bench.coordinator",
    "webhooks": "bench.webhooks",
    "rabbitmq": "bench.rabbitmq",
    "batch": "bench.batch",
    "sqs": "bench.sqs",
    "nats": "bench.nats",
    "redis": "bench.redis",
    "otel": "bench.otel",
    "cli": "bench.cli",
    "http": "bench.http",
    "console": "bench.console",
    "scaleout": "bench.scaleout",
    "soak": "bench.soak",
    "store": "bench.store",
}


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        # The loop `consumer-kit run` gives a worker; the peers run on the same one.
        failed += 0 if run_async(module.main()) else 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
