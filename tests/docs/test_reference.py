"""docs/reference.md lists every module's public names (its ``__all__``) as tests/docs/reference_tables.py
makes the tables, and `mkdocs build --strict` builds the site (no broken link, no page missing from the
navigation, no page in it that does not exist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.docs.blocks import ROOT
from tests.docs.reference_tables import MODULES, PAGE, page_tables, table


def test_the_reference_lists_each_module_as_it_exports_its_names() -> None:
    found = page_tables(PAGE.read_text())
    assert sorted(found) == sorted(MODULES), "every public module has its table"
    assert {module: found[module] for module in MODULES} == {module: table(module) for module in MODULES}, (
        "run: python -m tests.docs.reference_tables")


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").exists()
