"""The fenced code blocks of README.md and docs/**/*.md, and how the docs suite runs them.

Every block of a page runs (or is written, or checked) in order, in one fresh directory per page, as a
user who pastes them one after the other into a terminal in an empty project directory would. The
conventions a page follows:

```python
    A block whose first line is ``# <path>`` (``# app.py``, ``# test_orders.py``,
    ``# migrations/0001_orders.py``) is written to that file of the page's directory; later blocks run
    or import it. Any other python block runs as a script: ``python -`` from the page's directory (so
    ``import app`` finds a file written before), and must exit 0.

```toml / ```yaml / ```json / ```ini / ```dotenv
    Written to a file when the first line is ``# <path>`` (a json file is written without that line),
    otherwise parsed: it must be valid.

```sh / ```bash
    Run by ``bash -euo pipefail`` from the page's directory, with the virtualenv's ``bin`` first on
    ``PATH`` (as a user who installed the package) and the local services reachable (PostgreSQL,
    RabbitMQ, Redis, NATS on 127.0.0.1). A command ending with `` &`` runs in the background and is
    killed (its process group) at the end of the page. What a block exports and the directory it
    ``cd``-s to carry over to the page's later blocks, as in one terminal; a variable set without
    ``export`` does not.

```console
    The same, written as a terminal transcript: lines starting with ``$ `` are the commands (a
    command ending with ``\\`` continues on the next line); the other lines are their expected output.

```text
    Right after an sh / bash / python block in the same section (prose in between is fine), the output
    that block must print (stdout and stderr together). The rule: every non-blank expected line must
    be a line of the output, in the same order, other output lines in between allowed; lines are
    compared whole, trailing spaces ignored, and ``…`` (one character, U+2026) stands for any text
    within a line (an id, a time, a digest). Anywhere else a text block is only shown (a diagram).

Annotations are HTML comments on the lines right before a block (invisible on the site and on GitHub):

    <!-- docs: wait http://127.0.0.1:8000/readyz -->   after this block, wait (up to 60 s) until the
                                                      URL answers 2xx before the next block
    <!-- docs: env NAME=value -->                     set NAME for this block only
    <!-- docs: exit 2 -->                             this block must exit with status 2, not 0
    <!-- docs: timeout 120 -->                        this block may take 120 s (default 60)
    <!-- docs: not-run <reason> -->                   do not run this block (no Docker here, a package
                                                      index that does not have us yet); rare, and
                                                      counted and listed by the tests
    <!-- docs: checkout -->                           run this sh / bash / console block in a checkout of
                                                      the repository, for a command about the
                                                      repository's own files (``promtool check config
                                                      deploy/prometheus/prometheus.yml``): a copy of the
                                                      files git tracks, as the working tree has them,
                                                      made once per page; what the block exports carries
                                                      over, its directory does not

Any other language, an unknown annotation, or a fence that never closes fails the page's test.

Ports, databases and virtual hosts, so that pages run side by side (pytest-xdist) and apart from the
other tests: the ports in ``PORTS`` are replaced, in every block, annotation and expected output of a
page, by a free port of the page's own where they follow ``:``, ``=``, ``--port `` or ``-p ``
(``localhost:8000``, ``PORT=8000``, ``--port 8000``); a page that names the PostgreSQL database
``/consumer_kit_docs`` (in a URL such as ``postgresql://postgres@127.0.0.1:5432/consumer_kit_docs``)
gets a database of its own under another name, created before its first block and dropped after its
last; and a page that names RabbitMQ's default virtual host, ``amqp://guest:guest@127.0.0.1:5672/``
(or ``.../5672/%2F``), gets a virtual host of its own in its place (``.../5672/consumer_kit_docs_…``),
created before its first block, with every permission for ``guest``, and deleted after its last with
every queue and exchange the page declared in it. The runner makes it through RabbitMQ's management
HTTP API (``CK_TEST_RABBITMQ_API``, default ``http://127.0.0.1:15672``, as guest) when that answers,
else with ``rabbitmqctl``. Other URLs (another user, password or virtual host) are left as written.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORTS = (8000, 8080, 5000)
DATABASE = "consumer_kit_docs"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"

RUNNABLE = ("python", "sh", "bash", "console")
FILES = ("toml", "yaml", "json", "ini", "dotenv")
LANGUAGES = (*RUNNABLE, *FILES, "text")
ANNOTATIONS = ("wait", "env", "exit", "timeout", "not-run", "checkout")

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
_ANNOTATION = re.compile(r"^\s*<!--\s*docs:\s*(?P<kind>[a-z-]+)\s*(?P<arg>.*?)\s*-->\s*$")
_FILENAME = re.compile(r"^# (?P<path>[\w.-]+(?:/[\w.-]+)*)\s*$")
_DEFAULT_VHOST = re.compile(re.escape(AMQP_URL) + r"(?:%2F)?(?![\w%.-])")


class PageError(Exception):
    """A page that breaks the conventions above (an unknown language, a fence that never closes)."""


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path  # relative to the repository
    line: int  # of the opening fence, counted from 1
    lang: str  # the first word of the fence's info string, lower case ("" for none)
    text: str  # its content, without the fence's indentation, ending with a newline
    annotations: tuple[tuple[str, str], ...] = ()
    section: int = 0  # the number of headings before it on the page
    expected: Block | None = field(default=None, compare=False)  # the ```text block of its output
    is_output: bool = False  # a ```text block that is another block's expected output

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def filename(self) -> str | None:
        """The file this block is written to (its first line ``# <path>``), if any."""
        if self.lang not in ("python", *FILES):
            return None
        first = self.text.split("\n", 1)[0]
        found = _FILENAME.match(first)
        return found["path"] if found else None

    def annotation(self, kind: str) -> str | None:
        """The argument of this block's last ``kind`` annotation; None when it has none."""
        values = [arg for name, arg in self.annotations if name == kind]
        return values[-1] if values else None

    @property
    def not_run(self) -> str | None:
        """Why this block is not run, when it is marked so."""
        return self.annotation("not-run")

    @property
    def kind(self) -> str:
        """What the suite does with it: "run", "write", "check", "output" (of the
        run block before it), "shown" or "not-run"."""
        if self.not_run is not None:
            return "not-run"
        if self.lang == "text":
            return "output" if self.is_output else "shown"
        if self.filename is not None:
            return "write"
        return "run" if self.lang in RUNNABLE else "check"


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks run: README.md, then every page of docs/, relative to ``root``."""
    found = [Path("README.md")] if (root / "README.md").exists() else []
    return found + sorted(path.relative_to(root) for path in (root / "docs").rglob("*.md"))


def fence_lines(text: str) -> int:
    """How many lines of ``text`` open or close a fence: a count independent of :func:`parse`."""
    return sum(1 for line in text.splitlines() if line.lstrip().startswith(("```", "~~~")))


def parse(page: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced block of ``page`` (relative to ``root``), in order, each with its annotations, and
    each run block with the ```text block of its expected output."""
    blocks = list(_blocks(page, (root / page).read_text(encoding="utf-8").splitlines()))
    joined: list[Block] = []
    for block in blocks:
        if block.lang not in LANGUAGES:
            raise PageError(f"{block.where}: a ```{block.lang or '(no language)'} block: use one of "
                            f"{', '.join(LANGUAGES)}, so that the suite knows what to do with it")
        for name, _ in block.annotations:
            if name not in ANNOTATIONS:
                raise PageError(f"{block.where}: unknown annotation 'docs: {name}'")
        previous = joined[-1] if joined else None
        if (block.lang == "text" and previous is not None and previous.kind == "run"
                and previous.lang != "console" and previous.section == block.section and previous.expected is None):
            block = replace(block, is_output=True)
            joined[-1] = replace(previous, expected=block)
        joined.append(block)
    return joined


def _blocks(page: Path, lines: list[str]) -> Iterator[Block]:
    annotations: list[tuple[str, str]] = []
    section = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        opening = _FENCE.match(line)
        if opening is None:
            note = _ANNOTATION.match(line)
            if note:
                annotations.append((note["kind"], note["arg"]))
            elif line.strip():
                annotations = []  # an annotation belongs to the block right after it
                section += line.lstrip().startswith("#")
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: list[str] = []
        index += 1
        while index < len(lines):
            closing = _FENCE.match(lines[index])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"]:
                break
            body.append(lines[index][indent:] if lines[index][:indent].strip() == "" else lines[index])
            index += 1
        else:
            raise PageError(f"{page}:{index - len(body)}: a fence that never closes")
        info = opening["info"].split()
        lang = info[0].lower().lstrip("{.") if info else ""
        yield Block(page, index - len(body), lang, "\n".join(body) + "\n", tuple(annotations), section)
        annotations = []
        index += 1


def file_block(page: str | Path, path: str, root: Path = ROOT) -> str:
    """The content of the block of ``page`` that is written to ``path`` (its first line ``# <path>``):
    what a test outside the docs suite uses to run a page's example as the page shows it."""
    found = [block.text for block in parse(Path(page), root) if block.filename == path]
    if len(found) != 1:
        raise LookupError(f"{page} has {len(found)} blocks written to {path}, not one")
    return found[0]


def console_commands(block: Block) -> tuple[str, str]:
    """A console block's commands (its ``$ `` lines and their continuations) and its expected output."""
    commands: list[str] = []
    output: list[str] = []
    continued = False
    for line in block.text.splitlines():
        if continued:
            commands.append(line)
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            output.append(line)
            continue
        continued = line.endswith("\\")
    if not commands:
        raise PageError(f"{block.where}: a console block without a `$ ` command line")
    return "\n".join(commands) + "\n", "\n".join(output) + "\n"


def mismatch(expected: str, actual: str) -> str | None:
    """None when ``actual`` shows every line of ``expected`` in order (see the rule above), else the
    first expected line it lacks."""
    lines = [line.rstrip() for line in actual.splitlines()]
    position = 0
    for wanted in (line.rstrip() for line in expected.splitlines()):
        if not wanted.strip():
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in wanted.split("…")), re.DOTALL)
        while position < len(lines) and not pattern.fullmatch(lines[position]):
            position += 1
        if position == len(lines):
            return wanted
        position += 1
    return None


def substitute(text: str, ports: dict[int, int], database: str | None, vhost: str | None = None) -> str:
    """``text`` with a page's own ports, database and virtual host in place of the documented ones."""
    for documented, own in ports.items():
        text = re.sub(rf"(?:(?<=[:=])|(?<=--port )|(?<=-p )){documented}(?!\d)", str(own), text)
    if database is not None:
        text = re.sub(rf"/{DATABASE}(?!\w)", f"/{database}", text)
    if vhost is not None:
        text = _DEFAULT_VHOST.sub(AMQP_URL + vhost, text)
    return text


def names_default_vhost(text: str) -> bool:
    """Whether ``text`` names RabbitMQ's default virtual host as :data:`AMQP_URL` does (see above)."""
    return _DEFAULT_VHOST.search(text) is not None


def tally(page: Path, root: Path = ROOT) -> dict[str, int]:
    """How many blocks ``page`` has, and how many of each kind (what tests/docs/counts.py pins)."""
    blocks = parse(page, root)
    kinds = collections.Counter(block.kind for block in blocks)
    return {"found": len(blocks), "run": kinds["run"], "written": kinds["write"], "checked": kinds["check"],
            "outputs": kinds["output"], "shown": kinds["shown"], "not_run": kinds["not-run"]}


if __name__ == "__main__":  # python -m tests.docs.blocks: the counts as they are now, to paste into counts.py
    totals: collections.Counter[str] = collections.Counter()
    for each in pages():
        found = tally(each)
        totals.update(found)
        print(f'    "{each}": dict({", ".join(f"{name}={count}" for name, count in found.items())}),')
    print(f'TOTAL = dict({", ".join(f"{name}={count}" for name, count in totals.items())})')
