"""The ``consumer-kit`` command's help: every option explained, a default shown only when there is one
(never ``(default: None)``), a description for every command, the environment variables each reads
(from Settings' own fields), ports checked at parse time, ``--version``."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout

import pytest

from consumer_kit.cli import build_parser
from consumer_kit.cli.main import LAZY
from consumer_kit.cli.parsing import Parser, environment_variables
from consumer_kit.settings import Settings


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:  # argparse offers no public walk of its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from parsers(sub)


def leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [p for p in parsers(parser) if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


# parked and schedule are registered by their own modules (cli/parked.py, cli/schedules.py), whose
# descriptions and environment lists are theirs to give; these tests hold the rest of the command to it.
LAZY_PROGS = tuple(f"consumer-kit {name}" for entry in LAZY for name in entry.names)


def ours(parser: argparse.ArgumentParser) -> bool:
    return not parser.prog.startswith(LAZY_PROGS)


def parse(*argv: str) -> tuple[int | str | None, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    return exited.value.code, out.getvalue(), err.getvalue()


def test_every_option_has_help_and_a_default_only_when_it_has_one() -> None:
    seen = shown = 0
    for parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for noise in ("(default: None)", "(default: False)", "(default: [])", "(default: )"):
            assert noise not in text, (parser.prog, noise)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help"
            seen += 1
            if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
                assert f"(default: {action.default})" in text, (parser.prog, action.option_strings)
                shown += 1
    assert seen > 50 and shown > 5


def test_the_program_and_every_command_have_a_description() -> None:
    checked = [parser for parser in parsers(build_parser()) if ours(parser)]
    assert len(checked) >= 10
    for parser in checked:
        assert parser.description and len(parser.description) > 20, parser.prog
        assert parser.description in " ".join(parser.format_help().split()) or "\n" in parser.description


def test_every_command_lists_the_environment_it_reads_from_settings_fields() -> None:
    commands = [parser for parser in leaves(build_parser()) if ours(parser)]
    assert {p.prog for p in commands} >= {"consumer-kit run", "consumer-kit db upgrade", "consumer-kit db check",
                                          "consumer-kit db revision", "consumer-kit coordinator serve",
                                          "consumer-kit outbox relay", "consumer-kit demo"}
    for parser in commands:
        assert isinstance(parser, Parser) and parser.environment, parser.prog
        epilog = " ".join(parser.format_help().split()).partition("Environment: ")[2]
        assert "; LOG_LEVEL, LOG_FORMAT." in epilog, (parser.prog, epilog)
        for name in environment_variables(parser.environment):
            assert name in epilog, (parser.prog, name)
    run = next(p for p in commands if p.prog == "consumer-kit run")
    assert environment_variables(run.environment) == [name.upper() for name in Settings.model_fields]
    demo = next(p for p in commands if p.prog == "consumer-kit demo")
    assert "DATABASE_URL" not in environment_variables(demo.environment)


def test_environment_names_are_settings_fields_upper_cased() -> None:
    # environment_variables() maps a field to its variable by name: no prefix, no alias.
    assert Settings.model_config.get("env_prefix", "") == ""
    assert all(field.alias is None and field.validation_alias is None for field in Settings.model_fields.values())
    assert environment_variables(["outbox_*", "!outbox_retention_seconds", "database_url"])[:2] == [
        "DATABASE_URL", "OUTBOX_BATCH_SIZE"]
    with pytest.raises(ValueError, match="no setting matches 'no_such_setting'"):
        environment_variables(["no_such_setting"])


def test_the_top_level_help_is_the_same_without_the_lazy_commands_loaded() -> None:
    assert build_parser(lazy=True).format_help() == build_parser().format_help()
    assert "COMMAND" in build_parser().format_help()


def test_log_level_is_taken_after_the_command_too() -> None:
    assert build_parser().parse_args(["parked", "list", "--log-level", "debug"]).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "error", "db", "check"]).log_level == "ERROR"
    assert not hasattr(build_parser().parse_args(["db", "check"]), "log_level")  # then LOG_LEVEL, else INFO


def test_every_command_runs_a_function() -> None:
    # A sub-command's func is what main() calls: a parser named like its function once shadowed one.
    found = leaves(build_parser())
    assert len(found) > 10
    for parser in found:
        func = parser.get_default("func")
        assert callable(func) and not isinstance(func, argparse.ArgumentParser), parser.prog


@pytest.mark.parametrize(("prog", "argv"), [("consumer-kit run", ["run", "m:app"]),
                                            ("consumer-kit coordinator serve", ["coordinator", "serve"])],
                         ids=["run", "coordinator serve"])
@pytest.mark.parametrize("value", ["70000", "65536", "-1", "http"])
def test_a_port_out_of_range_is_one_line_and_exit_2(prog: str, argv: list[str], value: str) -> None:
    code, out, err = parse(*argv, "--port", value)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith(f"{prog}: argument --port: {value!r}" if value == "http" else f"{prog}: argument --port: "
                           f"{value} is not a port: give 0 to 65535 (0: any free port)"), line


@pytest.mark.parametrize("value", [0, 1, 8080, 65535])
def test_ports_in_range_are_taken(value: int) -> None:
    assert build_parser().parse_args(["run", "m:app", "--port", str(value)]).port == value
    assert build_parser().parse_args(["coordinator", "serve", "--port", str(value)]).port == value


def test_version() -> None:
    code, out, err = parse("--version")
    assert code == 0 and err == ""
    assert out == f"consumer-kit {importlib.metadata.version('consumer-kit')}\n"


def test_a_missing_env_file_or_app_dir_is_one_line() -> None:
    code, _out, err = parse("--env-file", "/nonexistent/ck.env", "db", "check")
    assert code == 2 and err.splitlines() == [
        "consumer-kit: argument --env-file: '/nonexistent/ck.env': no such file (see consumer-kit --help)"]
    code, _out, err = parse("run", "m:app", "--app-dir", "/nonexistent/ck")
    assert code == 2 and len(err.splitlines()) == 1 and "'/nonexistent/ck': no such directory" in err
