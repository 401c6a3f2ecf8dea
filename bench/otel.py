"""What tracing costs a RabbitMQ worker: the rabbitmq benchmark's consumer-kit contenders, three ways.

- without: a process in which ``opentelemetry`` cannot be imported (the ``otel`` extra not installed);
- api:     the extra installed, no SDK configured (OpenTelemetry's default provider): tracing is off;
- sdk:     the SDK configured (a ``BatchSpanProcessor`` into an ``InMemorySpanExporter``): every
           delivery traced, its spans exported.

Each run is a worker process of its own (the only way to have "not installed" and "installed" side by
side), consuming a queue filled beforehand; its rate is measured as the rabbitmq benchmark measures it
(from the app's start to the last settlement), with OpenTelemetry imported beforehand: neither process
start-up nor imports are counted. Rounds alternate the variants (in a rotating
order, since the machine's load drifts); the printed numbers are medians over rounds of each round's
``api / without`` rate ratio (target: within 3%) and of the SDK's extra time per delivery,
``1/rate(sdk) - 1/rate(without)``. The worker's own CPU time per delivery is printed too: on a
shared machine it moves far less with the neighbours' load than the rates do.

Run: ``python -m bench otel`` with PostgreSQL and RabbitMQ on 127.0.0.1 (``CK_BENCH_OTEL_MESSAGES``,
``CK_BENCH_OTEL_ROUNDS``, ``CK_BENCH_OTEL_PATHS`` (``one-txn,two-txn``), and the rabbitmq benchmark's
settings override).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import sys
import time
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

from bench.common import scratch_database

MESSAGES = int(os.environ.get("CK_BENCH_OTEL_MESSAGES", "10000"))
ROUNDS = int(os.environ.get("CK_BENCH_OTEL_ROUNDS", "5"))
PATHS = tuple(os.environ.get("CK_BENCH_OTEL_PATHS", "one-txn,two-txn").split(","))
VARIANTS = ("without", "api", "sdk")


class _NoOpenTelemetry(MetaPathFinder):
    """Makes ``import opentelemetry...`` fail as it does where the extra is not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def worker(variant: str, path: str, queue: str, count: int, url: str) -> None:
    """One run in this process: print ``{"rate": ..., ...}`` as a JSON line."""
    if variant == "without":
        sys.meta_path.insert(0, _NoOpenTelemetry())
    else:  # imported once per process, before the timed run (which starts with the app's start)
        import opentelemetry.propagate
        import opentelemetry.trace  # noqa: F401
    exporter = provider = None
    if variant == "sdk":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=65536))
        trace.set_tracer_provider(provider)

    from bench.rabbitmq import PREFETCH, _framework
    from consumer_kit.cli import run_async

    cpu = time.process_time()
    rate = run_async(_framework(queue, count, PREFETCH, url, single=path == "one-txn"))
    cpu = time.process_time() - cpu  # this process's CPU (the span processor's thread included)
    answer: dict[str, Any] = {"rate": rate, "cpu_us": cpu / count * 1e6,
                              "otel_loaded": any(name.startswith("opentelemetry") for name in sys.modules)}
    if provider is not None and exporter is not None:
        provider.force_flush()
        answer["spans"] = len(exporter.get_finished_spans())
    print(json.dumps(answer))


async def _run(variant: str, path: str, queue: str, count: int, url: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.otel", "worker", variant, path, queue, str(count), url,
        stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the {variant} worker failed ({process.returncode})")
    answer: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return answer


async def main() -> bool:
    """Run the variants in alternating rounds and print the ratio and the SDK's cost; ``True`` when
    the untraced worker with the API installed is within 3% of the one without it."""
    import logging

    from sqlalchemy import text

    from bench.rabbitmq import _delete, _fill
    from consumer_kit.store import create_engine, upgrade

    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    count = MESSAGES
    rates: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    spans: dict[str, int] = {}
    loaded: dict[str, bool] = {}
    queues: list[str] = []
    async with scratch_database() as dsn:
        url = dsn.replace("postgresql://", "postgresql+asyncpg://")
        engine = create_engine(url)
        await upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE bench_effects (id bigserial PRIMARY KEY, body text NOT NULL)"))
        await engine.dispose()
        try:
            for round_ in range(ROUNDS):
                order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
                for path in PATHS:
                    for variant in order:
                        queue = f"ck-bench-otel-{variant}-{secrets.token_hex(3)}"
                        queues.append(queue)
                        await _fill(queue, count)
                        answer = await _run(variant, path, queue, count, url)
                        rates.setdefault((path, variant), []).append(answer["rate"])
                        cpus.setdefault((path, variant), []).append(answer["cpu_us"])
                        loaded[variant] = answer["otel_loaded"]
                        if "spans" in answer:
                            spans[path] = answer["spans"]
        finally:
            await _delete(queues)
    print(f"tracing on the rabbitmq worker (PostgreSQL): {count} messages a run, {ROUNDS} rounds, each run a "
          "process of its own (medians of per-round figures)")
    print(f"  opentelemetry imported: without {loaded['without']}, api {loaded['api']}, sdk {loaded['sdk']}")
    ok = True
    for path in PATHS:
        without, api, sdk = (rates[(path, v)] for v in VARIANTS)
        ratio = statistics.median(a / w for a, w in zip(api, without, strict=True))
        overhead = statistics.median((1 / s - 1 / w) * 1e6 for s, w in zip(sdk, without, strict=True))
        within = abs(ratio - 1) <= 0.03
        ok &= within
        print(f"  {path}: without {statistics.median(without):7.0f} msg/s  api (no SDK) {statistics.median(api):7.0f} "
              f"msg/s  ratio {ratio:5.3f} (target within 3%: {'ok' if within else 'OUTSIDE'})")
        print(f"  {path}: sdk + in-memory exporter {statistics.median(sdk):7.0f} msg/s  overhead "
              f"{overhead:6.1f} us/delivery  ({spans.get(path, 0) / count:.1f} spans/delivery exported)")
        cpu_without, cpu_api, cpu_sdk = (cpus[(path, v)] for v in VARIANTS)
        cpu_ratio = statistics.median(a / w for a, w in zip(cpu_api, cpu_without, strict=True))
        cpu_extra = statistics.median(s - w for s, w in zip(cpu_sdk, cpu_without, strict=True))
        print(f"  {path}: worker CPU per delivery: without {statistics.median(cpu_without):6.1f} us, api "
              f"{statistics.median(cpu_api):6.1f} us (ratio {cpu_ratio:5.3f}), sdk "
              f"{statistics.median(cpu_sdk):6.1f} us (+{cpu_extra:5.1f} us)")
    return ok


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else:
        from consumer_kit.cli import run_async

        raise SystemExit(0 if run_async(main()) else 1)
