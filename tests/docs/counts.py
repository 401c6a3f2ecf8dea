"""How many blocks each page has, and what the docs suite does with them (tests/docs/test_docs.py):
found, run (scripts and commands), written (files), checked (configuration parsed), outputs (expected
outputs compared), shown (text only: a diagram) and not_run (annotated `docs: not-run`, with a reason).

Whoever adds, removes or changes the kind of a block updates its page's line here: a block that the
suite stopped running, or never found, shows as a difference."""

from __future__ import annotations

EXPECTED: dict[str, dict[str, int]] = {
    "docs/getting-started.md": {"found": 10, "run": 4, "written": 1, "checked": 0, "outputs": 3, "shown": 0,
                                "not_run": 2},
}

TOTAL = {"found": 10, "run": 4, "written": 1, "checked": 0, "outputs": 3, "shown": 0, "not_run": 2}
