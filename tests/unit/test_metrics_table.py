"""The README's metrics table lists exactly the metrics the code registers, with their types."""

from __future__ import annotations

from tests.metric_names import documented_metrics, registered_metrics


def test_the_readme_table_lists_every_registered_metric_and_no_other() -> None:
    registered, documented = registered_metrics(), documented_metrics()
    assert len(registered) >= 27  # the walk found the collectors of every layer
    assert sorted(set(registered) - set(documented)) == [], "registered but not in README.md's table"
    assert sorted(set(documented) - set(registered)) == [], "in README.md's table but not registered"
    assert {name: kind for name, kind in documented.items() if registered[name] != kind} == {}
