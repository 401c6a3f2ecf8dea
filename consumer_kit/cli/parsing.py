"""How the ``consumer-kit`` command's parsers read and print, for every sub-command module.

- :class:`Parser`: a usage error is one line (exit 2); an option's help shows its default only when
  there is one to show (never ``(default: None)``); ``environment=`` names the settings a command
  reads, and its help lists their environment variables, taken from
  :class:`~consumer_kit.settings.Settings` when the help is printed (so the list stays true, and
  building the parser imports no pydantic-settings).
- :func:`port`, :func:`existing_file`, :func:`existing_directory`: argument types that refuse a bad
  value in one line at parse time; :func:`app_dir_option` adds ``--app-dir`` to a command that loads
  an app.

A sub-command module makes its parsers with ``commands.add_parser(name, ..., environment=(...))``
(the sub-parsers of a :class:`Parser` are Parsers) or the ``command`` factory it is given, which
passes keyword arguments on.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
from collections.abc import Sequence
from typing import Any, NoReturn

EVERY_SETTING = ("*",)
"""``environment=EVERY_SETTING``: all of Settings, for a command that loads an app (whose ``Settings()``
reads every variable)."""

DATABASE = ("database_url", "app_migrations", "app_migrations_table")
"""The settings of a command that opens consumer-kit's database and checks its schema (and the app's)."""

COMMON_VARIABLES = "LOG_LEVEL, LOG_FORMAT"
"""Read by every command (before its settings), unless --log-level or --log-format is given."""

MAX_PORT = 65_535


class Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (exit 2), not the usage block; ``environment`` is a list of
    Settings field names (``fnmatch`` patterns: ``outbox_*``) whose variables the help lists."""

    def __init__(self, *args: Any, environment: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environment = tuple(environment)
        self.notes = self.epilog  # the caller's own epilog, after the environment

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """As argparse's, and an option with a default worth showing says it in its help."""
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.help and shows_default(action.default) \
                and "%(default)" not in action.help:
            action.help += " (default: %(default)s)"
        return action

    def format_help(self) -> str:
        """As argparse's, with the environment variables of ``environment`` as the epilog (looked up
        now, not when the parser was built)."""
        if self.environment:
            self.epilog = " ".join(filter(None, [environment_epilog(self.environment), self.notes]))
        return super().format_help()


def shows_default(default: object) -> bool:
    """Whether an option's default says something: not when it is unset (None, SUPPRESS), a flag's
    False, or empty."""
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    return not (isinstance(default, str | list | tuple) and not default)


def environment_variables(fields: Sequence[str]) -> list[str]:
    """The environment variable of each Settings field that ``fields`` names, in the order Settings
    declares them. Each is a name or an ``fnmatch`` pattern (``outbox_*``); ``!pattern`` takes out what
    the ones before chose. A name or pattern that matches no field is a ValueError, so a renamed
    setting cannot leave a command's help wrong."""
    from consumer_kit.settings import Settings  # pydantic-settings: only when a help is printed

    declared = list(Settings.model_fields)
    chosen: set[str] = set()
    for pattern in fields:
        matched = fnmatch.filter(declared, pattern.removeprefix("!"))
        if not matched:
            raise ValueError(f"no setting matches {pattern!r}")
        if pattern.startswith("!"):
            chosen.difference_update(matched)
        else:
            chosen.update(matched)
    return [variable(name) for name in declared if name in chosen]


def variable(field: str) -> str:
    """A Settings field's environment variable (Settings has no prefix, and no field an alias)."""
    return field.upper()


def environment_epilog(fields: Sequence[str]) -> str:
    """The help's closing paragraph: the variables of ``fields`` (see :func:`environment_variables`)."""
    return (f"Environment: {', '.join(environment_variables(fields))} (read by Settings, from a .env file in "
            f"the current directory too); {COMMON_VARIABLES}.")


def sentence(text: str) -> str:
    """A one-line help as a sentence (capitalised, with its full stop), for a description."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def port(value: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (0: any free port, which the server's log names)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= number <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{number} is not a port: give 0 to {MAX_PORT} (0: any free port)")
    return number


def existing_file(value: str) -> str:
    """An argparse type: a path to a file that exists."""
    if not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"{value!r}: no such file")
    return value


def existing_directory(value: str) -> str:
    """An argparse type: a path to a directory that exists."""
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r}: no such directory")
    return value


class Version(argparse.Action):
    """``--version``: print ``consumer-kit <version>`` (the installed distribution's) and exit; the
    version is looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("consumer-kit")
        except PackageNotFoundError:  # run from a checkout that was never installed
            found = "unknown (not installed)"
        print(f"consumer-kit {found}")  # on stdout, as argparse's own version action prints
        parser.exit()


def app_dir_option(parser: argparse.ArgumentParser) -> None:
    """``--app-dir DIR``, for a command that loads an app (it passes ``args.app_dir`` to ``load_app``)."""
    parser.add_argument("--app-dir", type=existing_directory, default=None, metavar="DIR",
                        help="look for the app's module (or file) in DIR, put first on the import path (unset: "
                        "the current directory)")
