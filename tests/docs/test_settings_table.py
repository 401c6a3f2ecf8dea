"""docs/configuration.md's table of settings is the one tests/docs/settings_table.py makes from Settings."""

from __future__ import annotations

from consumer_kit import Settings
from tests.docs.settings_table import MORE, PAGE, page_table, table


def test_the_page_lists_every_setting_as_settings_declares_it() -> None:
    assert page_table(PAGE.read_text()) == table(), "run: python -m tests.docs.settings_table"
    rows = [line for line in table().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [name.upper() for name in Settings.model_fields]
    assert "| `RETRY_LATER_SECONDS` | number, ≥ 0 | 5 |" in table()


def test_a_description_in_settings_replaces_the_one_kept_here() -> None:
    fields = Settings.model_fields
    assert sorted(name for name in MORE if name not in fields or fields[name].description) == []
