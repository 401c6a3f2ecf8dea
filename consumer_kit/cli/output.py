"""What the listing commands print (``parked list|groups|show|replay``, ``schedule list``): JSON lines for
scripts or an aligned table for people, chosen by one option that means the same everywhere."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

FORMATS = ("json", "table")

CELL_WIDTH = 60
"""A table cell longer than this is cut (with "…"): a table is for reading across."""


def add_format(parser: argparse.ArgumentParser) -> None:
    """The ``--format`` option: ``json`` (the default) or ``table``."""
    parser.add_argument("--format", choices=FORMATS, default="json",
                        help="JSON lines (for scripts) or an aligned table (for people)")


def print_rows(rows: Sequence[dict[str, Any]], fmt: str, columns: Sequence[str]) -> None:
    """``rows`` as JSON lines (every field), or as a table of ``columns`` (a header, then a line a row)."""
    if fmt == "json":
        for row in rows:
            print(json.dumps(row))
        return
    # A table of a few columns is a dozen lines; not worth a dependency.
    cells = [[cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[i]) for line in cells]) for i, column in enumerate(columns)]
    print("  ".join(column.upper().ljust(width) for column, width in zip(columns, widths, strict=True)).rstrip())
    for line in cells:
        print("  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")


def cell(value: Any) -> str:
    """One value as a table shows it: ``-`` for none, on one line, at most :data:`CELL_WIDTH` characters."""
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        value = ", ".join(cell(item) for item in value) or "-"
    elif isinstance(value, dict):
        value = ", ".join(f"{name}={cell(item)}" for name, item in value.items()) or "-"
    text = str(value).replace("\n", " ")
    return text if len(text) <= CELL_WIDTH else text[:CELL_WIDTH - 1] + "…"
