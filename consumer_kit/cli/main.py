"""The ``consumer-kit`` command's parser and entry point; each sub-command lives in a module of its own
(:mod:`.serve`, :mod:`.db`, :mod:`.parked`, :mod:`.schedules`, :mod:`.demo`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from consumer_kit import logs
from consumer_kit.cli import db, parked, schedules, serve
from consumer_kit.cli.running import load_app
from consumer_kit.errors import ConfigurationError

Command = Callable[[argparse.Namespace], int]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DESCRIPTION = "The ``consumer-kit`` command."


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (exit 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help shows its default."""


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid level {value!r}: choose {', '.join(LOG_LEVELS)}")
    return level


def _log_format(value: str) -> str:
    log_format = value.strip().lower()
    if log_format not in logs.LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"invalid log format {value!r}: choose {', '.join(logs.LOG_FORMATS)}")
    return log_format


def _demo(args: argparse.Namespace) -> int:
    from consumer_kit.cli import demo  # the testing harness and the embedded coordinator: only when asked

    return demo.command(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (sub-commands register their own options)."""
    parser = _Parser(prog="consumer-kit", description=DESCRIPTION, formatter_class=_Help)
    # --log-level and --log-format work after a sub-command too, where they override the ones before
    # (SUPPRESS: unset leaves the top-level value alone; unset everywhere, LOG_LEVEL / LOG_FORMAT decide).
    for options in (parser, common := argparse.ArgumentParser(add_help=False)):
        options.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                             help=f"how much to log: {', '.join(LOG_LEVELS)} (DEBUG: consumer-kit's own logs "
                             "only; default: LOG_LEVEL, else INFO)")
        options.add_argument("--log-format", type=_log_format, default=argparse.SUPPRESS,
                             help="text, or json: one JSON object a line (default: LOG_FORMAT, else text)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = group.add_parser(name, parents=[common], formatter_class=_Help, **kwargs)
        return sub

    serve.add_commands(commands, command)
    db.add_commands(commands, command)
    parked.add_commands(commands, common, _Help, asyncio.run, load_app)

    demo = command(commands, "demo", help="the retry-safety recipe on embedded defaults")
    demo.add_argument("--verbose", action="store_true", help="also show the log of every step")
    demo.set_defaults(func=_demo)

    schedules.add_commands(commands, command)
    return parser


def _from_env(parser: argparse.ArgumentParser, variable: str, default: str, check: Callable[[str], str]) -> str:
    try:
        return check(os.environ.get(variable, default))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{variable}: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``consumer-kit`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", None) or _from_env(parser, "LOG_LEVEL", "INFO", _log_level)
    log_format = getattr(args, "log_format", None) or _from_env(parser, "LOG_FORMAT", "text", _log_format)
    args.log_level, args.log_format = level, log_format  # for the commands that pass them on (uvicorn)
    logs.configure(level, log_format)
    if level == "DEBUG":  # consumer-kit's own: libraries' debug logs (aio-pika dumps message ids) stay at INFO
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger("consumer_kit").setLevel(logging.DEBUG)
    func: Command = args.func
    try:
        return func(args)
    except ConfigurationError as exc:
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a missing optional extra: its hint is the whole message
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
