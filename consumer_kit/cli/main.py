"""The ``consumer-kit`` command's parser and entry point; each sub-command lives in a module of its own
(:mod:`.serve`, :mod:`.db`, :mod:`.parked`, :mod:`.console`, :mod:`.schedules`, :mod:`.demo`).

The command answers ``--help`` without importing what its sub-commands run (SQLAlchemy, the store,
the coordinator, uvicorn): each sub-command imports that when it runs. The modules of ``parked`` and
``schedule`` import the store as they load, so :func:`main` registers them only when one of them is
the command given; otherwise they appear by their one-line help alone (see :data:`LAZY`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from consumer_kit import logs
from consumer_kit.cli import console, db, serve
from consumer_kit.cli.parsing import COMMON_VARIABLES, EVERY_SETTING, Parser, Version, existing_file, sentence
from consumer_kit.cli.running import load_app
from consumer_kit.errors import ConfigurationError

Command = Callable[[argparse.Namespace], int]
Factory = Callable[..., argparse.ArgumentParser]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DESCRIPTION = ("Run and operate retry-safe consumers: workers on RabbitMQ, SQS, webhooks, CloudEvents and "
               "schedules whose redeliveries are harmless (an inbox, an outbox and an idempotency coordinator).")
EPILOG = (f"Configuration comes from the environment (and a .env file in the current directory, or --env-file "
          f"FILE); each command's --help lists the variables it reads. Every command reads {COMMON_VARIABLES} "
          "unless --log-level or --log-format is given.")
T = TypeVar("T")


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


def _run(main: Coroutine[Any, Any, T]) -> T:
    import asyncio  # not for --help: about a tenth of a second

    return asyncio.run(main)


def _demo(args: argparse.Namespace) -> int:
    from consumer_kit.cli import demo  # the testing harness and the embedded coordinator: only when asked

    return demo.command(args)


def _common_options(parser: argparse.ArgumentParser) -> None:
    # --log-level, --log-format and --env-file work after a sub-command too, where they override the ones
    # before (SUPPRESS: unset leaves the top-level value alone; unset everywhere, LOG_LEVEL / LOG_FORMAT decide).
    parser.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                        help=f"how much to log: {', '.join(LOG_LEVELS)} (DEBUG: consumer-kit's own logs "
                        "only; default: LOG_LEVEL, else INFO)")
    parser.add_argument("--log-format", type=_log_format, default=argparse.SUPPRESS,
                        help="text, or json: one JSON object a line (default: LOG_FORMAT, else text)")
    parser.add_argument("--env-file", type=existing_file, default=argparse.SUPPRESS, metavar="FILE",
                        help="read environment variables from FILE (KEY=value lines, as python-dotenv reads "
                        "them) before any setting; a variable already in the environment keeps its value")


def _parked(commands: Any, common: argparse.ArgumentParser, command: Factory) -> None:
    from consumer_kit.cli import parked

    parked.add_commands(commands, common, argparse.HelpFormatter, _run, load_app)


def _schedules(commands: Any, common: argparse.ArgumentParser, command: Factory) -> None:
    from consumer_kit.cli import schedules

    schedules.add_commands(commands, command)


@dataclass(frozen=True)
class Lazy:
    """A command whose module is imported only when the command is given: ``names`` are its name and
    aliases, ``help`` its line in ``consumer-kit --help`` (the same words its module registers),
    ``register`` adds its parsers."""

    names: tuple[str, ...]
    help: str
    register: Callable[[Any, argparse.ArgumentParser, Factory], None]


LAZY = (
    Lazy(("parked", "dead-letters"), "inspect, replay and discard parked deliveries (dead letters)", _parked),
    Lazy(("schedule",), "fire a schedule's tick by hand (for an external cron) and show each schedule's state",
         _schedules),
)


def build_parser(chosen: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The argument parser, every sub-command registering its own options. ``lazy=True`` leaves out the
    parsers of the :data:`LAZY` commands but ``chosen`` (each is then its line of help alone)."""
    parser = Parser(prog="consumer-kit", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action=Version, help="print consumer-kit's version and exit")
    for options in (parser, common := Parser(add_help=False)):
        _common_options(options)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if kwargs.get("help") and not kwargs.get("description"):  # a command's --help says what it does
            kwargs["description"] = sentence(kwargs["help"])
        sub: argparse.ArgumentParser = group.add_parser(name, parents=[common], **kwargs)
        return sub

    def add(entry: Lazy) -> None:
        if not lazy or chosen in entry.names:
            entry.register(commands, common, command)
        else:
            commands.add_parser(entry.names[0], aliases=list(entry.names[1:]), help=entry.help, add_help=False)

    lazy_parked, lazy_schedule = LAZY
    serve.add_commands(commands, command)
    db.add_commands(commands, command)
    add(lazy_parked)
    console.add_commands(commands, command)
    recipe = command(commands, "demo", help="the retry-safety recipe on embedded defaults",
                     description="Show the retry-safety recipe end to end (replay, conflict, inactive, an effect "
                     "once, a delivery with no stable id parked) on a temporary SQLite database and the embedded "
                     "coordinator; exit 1 if a step misbehaved.", environment=(*EVERY_SETTING, "!database_url"),
                     epilog="DATABASE_URL is not read: the demo's database is a temporary SQLite file.")
    recipe.add_argument("--verbose", action="store_true", help="also show the log of every step")
    recipe.set_defaults(func=_demo)
    add(lazy_schedule)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` parsed (the process's arguments when None), importing only the chosen command's module
    among the :data:`LAZY` ones; ``--help`` and usage errors exit here."""
    argv = sys.argv[1:] if argv is None else list(argv)
    first, _unknown = build_parser(lazy=True).parse_known_args(argv)
    return build_parser(first.command, lazy=True).parse_args(argv)


def _from_env(variable: str, default: str, check: Callable[[str], str]) -> str:
    try:
        return check(os.environ.get(variable, default))
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"{variable}: {exc}") from None


def _configure_logging(args: argparse.Namespace) -> None:
    level = getattr(args, "log_level", None) or _from_env("LOG_LEVEL", "INFO", _log_level)
    log_format = getattr(args, "log_format", None) or _from_env("LOG_FORMAT", "text", _log_format)
    args.log_level, args.log_format = level, log_format  # for the commands that pass them on (uvicorn)
    logs.configure(level, log_format)
    # Alembic announces each of its plugins at INFO as it is imported, which the commands now do after
    # logging is set up (they import the store when they run): import-time chatter, not the command's.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    if level == "DEBUG":  # consumer-kit's own: libraries' debug logs (aio-pika dumps message ids) stay at INFO
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger("consumer_kit").setLevel(logging.DEBUG)


def load_env_file(path: str) -> None:
    """``--env-file``: ``path``'s variables into the environment, where one is not set already (as
    uvicorn's ``--env-file``), before anything reads a setting."""
    from dotenv import load_dotenv  # how pydantic-settings reads a .env file, and its dependency

    try:
        load_dotenv(path, override=False)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"--env-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") \
            from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``consumer-kit`` script."""
    args = parse(argv)
    func: Command = args.func
    try:
        env_file = getattr(args, "env_file", None)
        if env_file is not None:
            load_env_file(env_file)
        _configure_logging(args)
        return func(args)
    except ConfigurationError as exc:
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a missing optional extra: its hint is the whole message
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
