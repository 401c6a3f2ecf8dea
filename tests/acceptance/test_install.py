"""The package as a user installs it: ``pip install .`` into a fresh virtualenv puts nothing at the
top level of site-packages but ``consumer_kit`` (the repository's ``sources/`` folder goes in as
``consumer_kit.sources``), so a user project with a ``sources`` package of its own imports both."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_package_installs_under_its_own_name_only(tmp_path: Path) -> None:
    # Built from a copy: setuptools keeps what it built in build/ and would package stale files of it.
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"))
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", wheels, tree)
    (wheel,) = wheels.glob("consumer_kit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"consumer_kit", wheel.name.split("-py")[0] + ".dist-info"}
    assert "consumer_kit/sources/schedules/__init__.py" in names and "consumer_kit/sources/py.typed" in names

    # A fresh virtualenv whose dependencies come from this one (a .pth line: the editable install of
    # this checkout is not among them, since .pth files of an added directory are not processed).
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel)
    installed = {p.name for p in site.iterdir()} - {"dependencies.pth", "__pycache__"}
    assert {n for n in installed if not n.endswith(".dist-info")} == {"consumer_kit"}, installed

    # A user project with a sources/ package of its own, next to consumer-kit's schedules.
    project = tmp_path / "project"
    (project / "sources").mkdir(parents=True)
    (project / "sources" / "__init__.py").write_text("")
    (project / "sources" / "schedules.py").write_text("MINE = True\n")
    (project / "app.py").write_text(textwrap.dedent("""
        import consumer_kit
        import sources.schedules
        from consumer_kit.sources.schedules import Schedule

        assert sources.schedules.MINE
        assert "site-packages" in consumer_kit.__file__, consumer_kit.__file__
        print(Schedule.__module__)
    """))
    done = _run(python, "app.py", cwd=project)
    assert done.stdout.strip() == "consumer_kit.sources.schedules.source"
