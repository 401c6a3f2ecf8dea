"""The metrics the code registers and the ones the README documents, for the tests that keep the README
table, the alert rules and the dashboard honest."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("consumer_kit_", "caracal_idempotency_")


def registered_metrics() -> dict[str, str]:
    """Every consumer-kit metric, by the name it is exposed under (counters with ``_total``), to its type.

    Imports every module of ``consumer_kit`` (its sources included) first (a source's collectors exist once its
    module is imported); the migrations are left out, since importing Alembic's ``env.py`` runs it, and so
    is ``__main__``, which runs the command."""
    import consumer_kit  # its sources are the sub-package consumer_kit.sources

    for module in pkgutil.walk_packages(consumer_kit.__path__, "consumer_kit."):
        if ".migrations" not in module.name and not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
    found = {}
    for family in REGISTRY.collect():
        if family.name.startswith(PREFIXES):
            found[family.name + ("_total" if family.type == "counter" else "")] = family.type
    return found


def series_names() -> set[str]:
    """The names of the time series those metrics expose, as a PromQL expression names them."""
    names = set()
    for name, kind in registered_metrics().items():
        if kind == "histogram":
            names.update(f"{name}_{suffix}" for suffix in ("bucket", "sum", "count"))
        else:
            names.add(name)
    return names


def documented_metrics() -> dict[str, str]:
    """The README's metrics table: metric name to the type it gives."""
    text = (ROOT / "docs" / "operating" / "metrics.md").read_text()
    section = text.split("\n## The metrics\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (counter|gauge|histogram) \|", section, re.MULTILINE)
    return dict(rows)
