"""Every code block of README.md and docs/ runs as pasted: one test per page runs the page's blocks in
order in a fresh directory (tests/docs/blocks.py says how each kind of block is run), and the counts of
what was found, run, written and not run are pinned (tests/docs/counts.py), so that no block escapes."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.docs import counts
from tests.docs.blocks import ROOT, fence_lines, pages, parse, tally
from tests.docs.runner import PageRun

PAGES = pages()


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    report = PageRun(page, tmp_path).run()
    assert report.ran or report.written or report.checked or report.shown or not parse(page), report


def test_the_parser_finds_every_fence() -> None:
    # Counted a second way (lines that open or close a fence): a block the parser missed shows here.
    assert {str(p): fence_lines((ROOT / p).read_text()) for p in PAGES} == {
        str(p): 2 * len(parse(p)) for p in PAGES}


def test_the_counts_of_blocks_are_the_pinned_ones() -> None:
    found = {str(page): tally(page) for page in PAGES}
    not_run = [f"{block.where}: {block.not_run}" for page in PAGES for block in parse(page) if block.not_run]
    assert found == counts.EXPECTED, "blocks not run:\n" + "\n".join(not_run)
    totals = collections.Counter[str]()
    for one in found.values():
        totals.update(one)
    assert dict(totals) == counts.TOTAL, dict(totals)
