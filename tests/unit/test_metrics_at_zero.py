"""``metrics.declare``: every series a worker can name when it starts exists at zero from then on, so
that Prometheus' ``increase()`` sees the first event of each (tests/acceptance/test_prometheus.py shows
the alert firing); and the reasons it declares are every reason the code parks with."""

from __future__ import annotations

import ast
import os
import secrets
from datetime import timedelta
from pathlib import Path

from prometheus_client import REGISTRY

import consumer_kit
from consumer_kit import ConsumerApp, Settings, metrics
from consumer_kit.sources.schedules import Schedule
from consumer_kit.sources.sqs import SQSSource
from consumer_kit.testing import InMemorySource
from tests.metric_names import registered_metrics

PACKAGE = Path(consumer_kit.__file__).parent


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def reasons_in_the_code() -> dict[str, str]:
    """Every reason a module of the package (its sources included) parks with by name, to where: the
    reason of ``fate.dead(work, "<reason>", ...)``, ``fate.park(spec, delivery, digest, "<reason>", ...)``,
    ``SomeError(..., reason="<reason>")`` and a ``reason = "<reason>"`` in an error class."""
    found: dict[str, str] = {}
    paths = [Path(top, file) for top, _dirs, files in os.walk(PACKAGE, followlinks=True) for file in files]
    for path in sorted(p for p in paths if p.suffix == ".py"):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            reasons: list[str | None] = []
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if name == "dead" and len(node.args) > 1:
                    reasons.append(_literal(node.args[1]))
                elif name == "park" and len(node.args) > 3:
                    reasons.append(_literal(node.args[3]))
                elif name.endswith("Error"):
                    reasons.extend(_literal(k.value) for k in node.keywords if k.arg == "reason")
            elif isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, ast.Assign):
                        targets, assigned = statement.targets, statement.value
                    elif isinstance(statement, ast.AnnAssign):
                        targets, assigned = [statement.target], statement.value
                    else:
                        continue
                    if any(isinstance(t, ast.Name) and t.id == "reason" for t in targets):
                        reasons.append(_literal(assigned))
            for reason in reasons:
                if reason is not None:
                    found[reason] = f"{where}:{node.lineno}"
    return found


def test_every_reason_the_code_parks_with_is_declared() -> None:
    registered_metrics()  # imports every module, so that every error class is known
    in_code = reasons_in_the_code()
    # The reading finds what it must judge (one that found nothing would pass anything).
    assert {"retries_exhausted", "arrived_after_retention", "terminal", "unparseable",
            "envelope_mismatch"} <= set(in_code)
    declared = set(metrics.park_reasons())
    assert {reason: where for reason, where in in_code.items() if reason not in declared} == {}


def test_every_reason_the_http_server_cuts_a_connection_off_for_is_declared() -> None:
    tree = ast.parse((PACKAGE / "http/server.py").read_text())
    counted = {_literal(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Attribute) and node.func.attr in ("_refuse", "_count") and node.args}
    assert counted - {None} == set(metrics.CUT_OFF_REASONS)


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_declare_makes_every_series_of_each_source_at_zero_and_keeps_counts() -> None:
    token = secrets.token_hex(4)
    memory = InMemorySource(namespace=f"zero-{token}", version=1)
    schedule = Schedule(f"zero-{token}", every=timedelta(hours=1))
    sqs = SQSSource(queue_url=f"http://127.0.0.1:1/000000000000/zero-{token}", namespace=f"zero-sqs-{token}",
                    version=1)
    assert sample("consumer_kit_inbox_takeovers_total", source=memory.name) is None  # nothing before
    metrics.declare([memory, schedule, sqs])
    for source in (memory.name, schedule.name, sqs.name):
        for reason in metrics.park_reasons():
            assert sample("consumer_kit_dead_letters_total", source=source, reason=reason) == 0, reason
        assert sample("consumer_kit_inbox_takeovers_total", source=source) == 0
        for action in ("parked", "processed"):
            assert sample("consumer_kit_late_deliveries_total", source=source, action=action) == 0
        for outcome in metrics.OUTCOMES:
            assert sample("consumer_kit_deliveries_total", source=source, outcome=outcome) == 0, outcome
            assert sample("consumer_kit_deliveries_created", source=source, outcome=outcome) is not None
    for reason in ("coalesced", "misfire", "too_many", "overlap"):
        assert sample("consumer_kit_schedule_skipped_ticks_total", schedule=schedule.name, reason=reason) == 0
    for name in ("consumer_kit_sqs_s3_test_events_total", "consumer_kit_sqs_received_while_held_total",
                 "consumer_kit_sqs_receive_failures_total"):
        assert sample(name, source=sqs.name) == 0, name
    for action in ("delete", "visibility", "dead_letter_copy"):
        assert sample("consumer_kit_sqs_settlements_total", source=sqs.name, action=action) == 0
    assert sample("consumer_kit_swept_total", table="inbox") is not None
    for reason in metrics.CUT_OFF_REASONS:
        assert sample("consumer_kit_http_cut_off_total", reason=reason) is not None

    # Declared again (a second app, a restart in process), what was counted stays counted.
    metrics.DEAD_LETTERS.labels(memory.name, "terminal").inc()
    metrics.for_source(memory.name).delivered("dead_lettered")
    metrics.declare([memory])
    assert sample("consumer_kit_dead_letters_total", source=memory.name, reason="terminal") == 1
    assert sample("consumer_kit_deliveries_total", source=memory.name, outcome="dead_lettered") == 1


async def test_a_started_app_has_declared_its_sources(tmp_path: Path) -> None:
    source = InMemorySource(namespace=f"started-{secrets.token_hex(4)}", version=1)
    app = ConsumerApp(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/app.db",
                               idempotency_hmac_key="test-hmac-key-0123456789abcdef"))

    @app.handler(source)
    async def handle(ctx: object) -> None:
        """Nothing."""

    assert sample("consumer_kit_dead_letters_total", source=source.name, reason="terminal") is None
    async with app.running():
        assert sample("consumer_kit_dead_letters_total", source=source.name, reason="terminal") == 0
        assert sample("consumer_kit_inbox_takeovers_total", source=source.name) == 0
