"""The package as a release makes it and a user installs it. ``python -m build`` makes the sdist, and
the wheel from that sdist, out of a copy of the tree; both pass ``twine check --strict`` and carry the
project's metadata. Installed into a fresh virtualenv, the wheel puts nothing at the top level of
site-packages but ``consumer_kit`` (the repository's ``sources/`` folder goes in as
``consumer_kit.sources``), and, with the ``webhooks`` extra and its dependencies from the index, runs
the getting-started example in a directory with no repository near it."""

from __future__ import annotations

import email.message
import email.parser
import hashlib
import hmac
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from consumer_kit.testing.server import free_port
from tests.docs.blocks import file_block
from tests.processes import stop_cleanly, wait_until_served

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BIN = Path(sys.executable).parent  # this virtualenv's: build, twine and uv come with the dev extra
# What a fresh machine does not have: nothing that configures consumer-kit, no virtualenv, no checkout.
CONFIGURATION = re.compile(r"^(IDEMPOTENCY_|COORDINATOR_|RABBITMQ_|SQS_|DATABASE_URL$|VIRTUAL_ENV$|PYTHONPATH$)")

# The getting-started page's app.py (docs/getting-started.md), exactly as the page shows it: a user saves it.
GETTING_STARTED = file_block("docs/getting-started.md", "app.py")


@dataclass(frozen=True)
class Built:
    """What ``python -m build`` made: the sdist and the wheel built from it."""

    sdist: Path
    wheel: Path


def _run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args}\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist and wheel of a copy of the tree (setuptools keeps what it built in build/ and would
    package stale files of it), as a release builds them: the wheel from the unpacked sdist, so a file
    the sdist leaves out is missing from the wheel too."""
    where = tmp_path_factory.mktemp("build")
    tree = where / "tree"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache",
        ".pytest_cache", ".hypothesis", "consumer-kit.db*"))
    # uv makes build's isolated environment: the same setuptools, without seeding a pip into it.
    _run(sys.executable, "-m", "build", "--installer", "uv", "--outdir", where / "dist", tree,
         env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    (sdist,) = (where / "dist").glob("consumer_kit-*.tar.gz")
    (wheel,) = (where / "dist").glob("consumer_kit-*.whl")
    return Built(sdist, wheel)


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))


def sdist_metadata(sdist: Path) -> email.message.Message:
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/PKG-INFO")
        assert member is not None
        return email.parser.Parser().parsestr(member.read().decode("utf-8"))


def test_the_sdist_and_wheel_pass_twine_check_and_carry_the_metadata(built: Built) -> None:
    _run(BIN / "twine", "check", "--strict", built.sdist, built.wheel)
    readme = (ROOT / "README.md").read_text()
    for metadata in (wheel_metadata(built.wheel), sdist_metadata(built.sdist)):
        assert metadata["Name"] == "consumer-kit" and metadata["Version"] == PROJECT["version"]
        assert metadata["Summary"] == PROJECT["description"] and len(metadata["Summary"]) > 40
        assert metadata["License-Expression"] == "Apache-2.0" and metadata["License-File"] == "LICENSE"
        classifiers: list[str] = metadata.get_all("Classifier", [])
        assert classifiers == PROJECT["classifiers"] and "Programming Language :: Python :: 3.11" in classifiers
        urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL", []))
        assert urls == PROJECT["urls"] and urls["Repository"].startswith("https://github.com/")
        extras = set(metadata.get_all("Provides-Extra", []))
        assert extras == set(PROJECT["optional-dependencies"])
        assert {"webhooks", "schedules", "rabbitmq", "sqs", "cloudevents", "postgres", "all"} <= extras
        assert metadata["Requires-Python"] == ">=3.11" and metadata["Keywords"]
        assert metadata["Description-Content-Type"] == "text/markdown"
        assert str(metadata.get_payload()).strip() == readme.strip()  # the README is the long description
    with zipfile.ZipFile(built.wheel) as archive:
        names = archive.namelist()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "consumer-kit = consumer_kit.cli:main" in entry_points


def test_the_package_installs_under_its_own_name_only(built: Built, tmp_path: Path) -> None:
    names = zipfile.ZipFile(built.wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"consumer_kit", built.wheel.name.split("-py")[0] + ".dist-info"}
    assert "consumer_kit/sources/schedules/__init__.py" in names and "consumer_kit/sources/py.typed" in names
    # The console's templates and static files are package data: a wheel without them serves no page.
    assert {"consumer_kit/console/templates/base.html", "consumer_kit/console/static/console.js",
            "consumer_kit/console/static/console.css"} <= set(names)

    # A fresh virtualenv whose dependencies come from this one (a .pth line: the editable install of
    # this checkout is not among them, since .pth files of an added directory are not processed).
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", built.wheel)
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


def test_the_wheel_runs_the_getting_started_example_with_no_repository(built: Built, tmp_path: Path) -> None:
    # A virtualenv of its own, and the wheel with the webhooks extra and every dependency from the
    # index, as the docs install it (uv for pip: the same metadata, resolved in seconds).
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    _run(BIN / "uv", "pip", "install", "--quiet", "--python", venv / "bin" / "python", f"{built.wheel}[webhooks]")
    project = tmp_path / "project"  # far from the repository: nothing of it on the path
    project.mkdir()
    (project / "app.py").write_text(GETTING_STARTED)
    env = {name: value for name, value in os.environ.items() if not CONFIGURATION.match(name)}
    env["ORDERS_WEBHOOK_SECRET"] = secret = secrets.token_urlsafe(32)
    where = _run(venv / "bin" / "python", "-c", "import consumer_kit, app; print(consumer_kit.__file__)",
                 cwd=project, env=env).stdout.strip()
    assert where.startswith(str(venv)), where

    port = free_port()
    worker = subprocess.Popen([str(venv / "bin" / "consumer-kit"), "run", "app:app", "--port", str(port)],
                              cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_served(worker, f"http://127.0.0.1:{port}/readyz")
        body = b'{"id": "order-1", "amount": 12}'
        signature = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        url = f"http://127.0.0.1:{port}/orders"
        answers = [httpx.post(url, headers={"X-Signature": signature}, content=body, timeout=10) for _ in range(2)]
        assert [(a.status_code, a.json()) for a in answers] == [(200, {"outcome": "processed"}),
                                                                 (200, {"outcome": "duplicate"})]
        forged = httpx.post(url, headers={"X-Signature": "sha256=00"}, content=b'{"id": "order-2"}', timeout=10)
        assert forged.status_code == 401
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'consumer_kit_deliveries_total{outcome="processed",source="webhook:orders"} 1.0' in metrics
        assert 'consumer_kit_deliveries_total{outcome="duplicate",source="webhook:orders"} 1.0' in metrics
    finally:
        output = stop_cleanly(worker)
    assert "order order-1: 12" in output  # the handler ran, once
    assert output.count("order order-1: 12") == 1, output
    assert (project / "consumer-kit.db").exists() and (project / "consumer-kit.db.hmac-key").exists()
