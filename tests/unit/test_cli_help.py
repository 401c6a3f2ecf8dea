"""Every ``consumer-kit`` option has help text and its help shows the default."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from consumer_kit.cli import build_parser


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:  # argparse offers no public walk of its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from parsers(sub)


def test_every_option_has_help_and_shows_its_default() -> None:
    seen = 0
    for parser in parsers(build_parser()):
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), parser.prog
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help"
            if action.option_strings and action.default is not argparse.SUPPRESS:
                shown = " ".join(action.help.split())
                assert f"{shown} (default: {action.default})" in text, (parser.prog, action.option_strings)
            seen += 1
    assert seen > 50


def test_log_level_is_taken_after_the_command_too() -> None:
    assert build_parser().parse_args(["parked", "list", "--log-level", "debug"]).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "error", "db", "check"]).log_level == "ERROR"
    assert not hasattr(build_parser().parse_args(["db", "check"]), "log_level")  # then LOG_LEVEL, else INFO


def test_every_command_runs_a_function() -> None:
    # A sub-command's func is what main() calls: a parser named like its function once shadowed one.
    leaves = [p for p in parsers(build_parser())
              if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]
    assert len(leaves) > 10
    for parser in leaves:
        func = parser.get_default("func")
        assert callable(func) and not isinstance(func, argparse.ArgumentParser), parser.prog
