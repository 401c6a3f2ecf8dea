"""The ``consumer-kit`` command's help: every option explained, a default shown only when there is one
(never ``(default: None)``), a description for every command, the environment variables each reads
(from Settings' own fields), ports checked at parse time, ``--version``."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from consumer_kit.cli import build_parser
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
    checked = list(parsers(build_parser()))
    assert {"consumer-kit parked", "consumer-kit parked list", "consumer-kit parked groups", "consumer-kit parked show",
            "consumer-kit parked replay", "consumer-kit parked discard", "consumer-kit schedule",
            "consumer-kit schedule run", "consumer-kit schedule list"} <= {p.prog for p in checked}
    assert len(checked) >= 19
    for parser in checked:
        assert parser.description and len(parser.description) > 20, parser.prog
        assert parser.description in " ".join(parser.format_help().split()) or "\n" in parser.description


def test_every_command_lists_the_environment_it_reads_from_settings_fields() -> None:
    commands = leaves(build_parser())
    assert {p.prog for p in commands} == {
        "consumer-kit run", "consumer-kit db upgrade", "consumer-kit db check", "consumer-kit db revision",
        "consumer-kit db partition-inbox",
        "consumer-kit coordinator serve", "consumer-kit outbox relay", "consumer-kit demo",
        "consumer-kit parked list", "consumer-kit parked groups", "consumer-kit parked show",
        "consumer-kit parked replay", "consumer-kit parked discard", "consumer-kit schedule run",
        "consumer-kit schedule list", "consumer-kit console"}
    found: dict[str, list[str]] = {}
    for parser in commands:
        assert isinstance(parser, Parser) and parser.environment, parser.prog
        epilog = " ".join(parser.format_help().split()).partition("Environment: ")[2]
        assert "; LOG_LEVEL, LOG_FORMAT." in epilog, (parser.prog, epilog)
        variables = found[parser.prog.removeprefix("consumer-kit ")] = environment_variables(parser.environment)
        for name in variables:
            assert name in epilog, (parser.prog, name)
    every = [name.upper() for name in Settings.model_fields]
    # the app's Settings() reads all
    for loads_an_app in ("run", "parked replay", "schedule run", "schedule list", "console"):
        assert found[loads_an_app] == every, loads_an_app
    for reads_the_store in ("parked list", "parked groups", "parked show", "parked discard"):
        assert found[reads_the_store] == ["DATABASE_URL"], reads_the_store  # consumer-kit's tables, no app
    assert "DATABASE_URL" not in found["demo"]


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


@pytest.mark.parametrize("argv", [["parked", "replay", "m:app"], ["schedule", "run", "m:app", "nightly"],
                                  ["schedule", "list", "m:app"]], ids=lambda argv: " ".join(argv[:2]))
def test_the_commands_that_load_an_app_take_app_dir(argv: list[str], tmp_path: Path) -> None:
    assert build_parser().parse_args([*argv, "--app-dir", str(tmp_path)]).app_dir == str(tmp_path)
    assert build_parser().parse_args(argv).app_dir is None  # the current directory
    code, out, err = parse(*argv, "--app-dir", str(tmp_path / "nowhere"))
    assert code == 2 and out == "" and err.splitlines() == [
        f"consumer-kit {' '.join(argv[:2])}: argument --app-dir: '{tmp_path / 'nowhere'}': no such directory "
        f"(see consumer-kit {' '.join(argv[:2])} --help)"]


def test_actor_is_looked_up_when_the_command_runs_not_shown_as_a_default() -> None:
    # The login and host names are the machine's: a help printed elsewhere (the docs) would show another.
    for argv in (["parked", "replay", "m:app"], ["parked", "discard"]):
        assert build_parser().parse_args(argv).actor is None
        assert build_parser().parse_args([*argv, "--actor", "ops@example"]).actor == "ops@example"
    code, out, _err = parse("parked", "discard", "--help")
    assert code == 0 and "(unset: LOGIN@HOST, your login name and this machine's)" in " ".join(out.split())


@pytest.mark.parametrize(("value", "says"), [("-1", "'-1' is less than 0"), ("ten", "'ten' is not a whole number")])
def test_schedule_list_refuses_a_count_that_is_not_one_in_one_line(value: str, says: str) -> None:
    assert build_parser().parse_args(["schedule", "list", "m:app", "--recent", "0"]).recent == 0
    code, _out, err = parse("schedule", "list", "m:app", "--recent", value)
    assert code == 2 and err.splitlines() == [
        f"consumer-kit schedule list: argument --recent: {says} (see consumer-kit schedule list --help)"]
