"""docs/configuration.md's table of settings is the one tests/docs/settings_table.py makes from Settings."""

from __future__ import annotations

from consumer_kit import Settings
from tests.docs import settings_table
from tests.docs.settings_table import PAGE, page_table, table


def test_the_page_lists_every_setting_as_settings_declares_it() -> None:
    assert page_table(PAGE.read_text()) == table(), "run: python -m tests.docs.settings_table"
    rows = [line for line in table().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [name.upper() for name in Settings.model_fields]
    assert "| `RETRY_LATER_SECONDS` | number, ≥ 0 | 5 |" in table()


def test_every_description_is_the_one_settings_gives() -> None:
    # No second home for them: the generator keeps no descriptions of its own.
    assert not hasattr(settings_table, "MORE")
    assert sorted(name for name, info in Settings.model_fields.items() if not info.description) == []
