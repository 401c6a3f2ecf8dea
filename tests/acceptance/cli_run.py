"""Running the ``consumer-kit`` command through its entry function (:func:`consumer_kit.cli.main`), in
this process: the same parser, commands and error handling as the script, without a Python start-up
per call. A test that needs the process itself (its exit, its files, its log) runs the script."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import Any

from consumer_kit.cli import main


@dataclass(frozen=True)
class Ran:
    """What a command did: its exit code and what it printed."""

    code: int
    out: str
    err: str

    def json(self) -> list[Any]:
        """Its JSON lines."""
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]

    @property
    def err_lines(self) -> list[str]:
        """Its stderr, line by line."""
        return self.err.splitlines()


def cli(*argv: str, fresh: tuple[str, ...] = ()) -> Ran:
    """``consumer-kit *argv``; the modules in ``fresh`` are imported anew (an app module reads its
    settings from the environment when it is imported)."""
    for name in fresh:
        sys.modules.pop(name, None)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own exits (--help, a usage error)
            code = exc.code if isinstance(exc.code, int) else 2
    return Ran(code, out.getvalue(), err.getvalue())
