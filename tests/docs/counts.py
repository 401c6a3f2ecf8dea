"""How many blocks each page has, and what the docs suite does with them (tests/docs/test_docs.py):
found, run (scripts and commands), written (files), checked (configuration parsed), outputs (expected
outputs compared), shown (text only: a diagram) and not_run (annotated `docs: not-run`, with a reason).

Whoever adds or removes a block, or changes what is done with it, updates its page's line here
(`python -m tests.docs.blocks` prints them as they are now): a block that the suite stopped running, or
never found, shows as a difference."""

from __future__ import annotations

EXPECTED: dict[str, dict[str, int]] = {
    "README.md": dict(found=6, run=2, written=0, checked=0, outputs=2, shown=0, not_run=2),
    "docs/configuration.md": dict(found=9, run=4, written=1, checked=0, outputs=4, shown=0, not_run=0),
    "docs/console.md": dict(found=13, run=6, written=2, checked=1, outputs=4, shown=0, not_run=0),
    "docs/coordinator.md": dict(found=10, run=6, written=0, checked=0, outputs=4, shown=0, not_run=0),
    "docs/getting-started.md": dict(found=10, run=4, written=1, checked=0, outputs=3, shown=0, not_run=2),
    "docs/handlers.md": dict(found=24, run=13, written=3, checked=0, outputs=8, shown=0, not_run=0),
    "docs/idempotent-endpoints.md": dict(found=25, run=12, written=2, checked=0, outputs=11, shown=0, not_run=0),
    "docs/inbox-outbox.md": dict(found=6, run=3, written=0, checked=0, outputs=3, shown=0, not_run=0),
    "docs/index.md": dict(found=0, run=0, written=0, checked=0, outputs=0, shown=0, not_run=0),
    "docs/operating/cli.md": dict(found=28, run=13, written=4, checked=0, outputs=11, shown=0, not_run=0),
    "docs/operating/compose.md": dict(found=3, run=1, written=0, checked=0, outputs=0, shown=0, not_run=2),
    "docs/operating/metrics.md": dict(found=9, run=4, written=1, checked=0, outputs=4, shown=0, not_run=0),
    "docs/operating/parked.md": dict(found=18, run=9, written=1, checked=0, outputs=8, shown=0, not_run=0),
    "docs/operating/pgbouncer.md": dict(found=5, run=1, written=0, checked=2, outputs=1, shown=1, not_run=0),
    "docs/operating/tracing.md": dict(found=14, run=5, written=2, checked=1, outputs=5, shown=1, not_run=0),
    "docs/operating/troubleshooting.md": dict(found=10, run=4, written=2, checked=0, outputs=4, shown=0, not_run=0),
    "docs/reference.md": dict(found=4, run=1, written=0, checked=0, outputs=1, shown=2, not_run=0),
    "docs/scaling.md": dict(found=0, run=0, written=0, checked=0, outputs=0, shown=0, not_run=0),
    "docs/sources/cloudevents.md": dict(found=9, run=5, written=1, checked=0, outputs=3, shown=0, not_run=0),
    "docs/sources/nats.md": dict(found=12, run=6, written=4, checked=0, outputs=2, shown=0, not_run=0),
    "docs/sources/rabbitmq.md": dict(found=12, run=7, written=3, checked=0, outputs=2, shown=0, not_run=0),
    "docs/sources/redis.md": dict(found=11, run=6, written=3, checked=0, outputs=2, shown=0, not_run=0),
    "docs/sources/schedules.md": dict(found=14, run=7, written=1, checked=0, outputs=6, shown=0, not_run=0),
    "docs/sources/sqs.md": dict(found=14, run=9, written=2, checked=0, outputs=3, shown=0, not_run=0),
    "docs/sources/webhooks.md": dict(found=15, run=8, written=3, checked=0, outputs=4, shown=0, not_run=0),
    "docs/testing.md": dict(found=9, run=3, written=3, checked=0, outputs=3, shown=0, not_run=0),
}

TOTAL = dict(found=290, run=139, written=39, checked=4, outputs=98, shown=4, not_run=6)
