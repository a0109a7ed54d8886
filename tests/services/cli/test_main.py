"""``draftline``'s parser: each command module registers its own subcommand, and ``build_parser`` reaches them all,
in the order ``--help`` lists them, with the defaults each command had when ``main.py`` defined them all."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import main as cli
from services.cli.commands import (
    demo,
    failures,
    make_target,
    make_tiny_model,
    preflight,
    resume,
    retrain,
    retry,
    run,
    serve,
    status,
    worker_health,
)

COMMANDS_DIR = Path(cli.__file__).parent / "commands"

# Each module, the one command it registers, a shortest valid command line and the values that line parses to.
REGISTERED = [
    (serve, "serve", ["serve", "controller"], {"service": "controller"}),
    (make_tiny_model, "make-tiny-model", ["make-tiny-model", "out"], {"dir": "out", "seed": 0}),
    (make_target, "make-target", ["make-target", "tiny", "out"], {"name": "tiny", "dir": "out"}),
    (run, "run", ["run", "--dataset", "d.jsonl"],
     {"dataset": "d.jsonl", "split": "train", "name": None, "limit": None, "model": None, "max_tokens": None,
      "hidden_storage": None, "run_config": None, "force": False, "controller": None}),
    (worker_health, "worker-health", ["worker-health", "generator"], {"role": "generator"}),
    (preflight, "preflight", ["preflight"], {"run_config": None, "force": False, "json": False}),
    (status, "status", ["status"], {"run": None, "json": False, "watch": False, "interval": 2.0}),
    (resume, "resume", ["resume"], {"run": None, "deep": False, "json": False}),
    (failures, "failures", ["failures"], {"run": None, "stage": None, "json": False}),
    (retry, "retry", ["retry", "r1", "5", "7"], {"run": "r1", "ids": [5, 7], "stage": None, "include_dropped": False}),
    (retrain, "retrain", ["retrain", "r1", "--name", "r2"], {"source": "r1", "name": "r2", "lr": None,
                                                            "run_config": None, "controller": None}),
    (demo, "demo", ["demo"], {"data": "./data", "target": "smollm2", "timeout": 1800.0}),
]
EXPECTED = [name for _, name, _, _ in REGISTERED]


def subparsers_of(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(subparsers_of(parser).choices)


def test_build_parser_reaches_every_registered_command_in_order():
    assert list(subcommands(cli.build_parser())) == EXPECTED


def test_every_command_module_is_listed_in_main():
    # The list in main.py is the only registry: a module written but not listed would be a command nobody can run.
    modules = {p.stem for p in COMMANDS_DIR.glob("*.py")} - {"__init__", "common"}
    assert {m.__name__.rsplit(".", 1)[1] for m in cli.COMMANDS} == modules


@pytest.mark.parametrize(("module", "name", "argv", "values"), REGISTERED, ids=EXPECTED)
def test_each_module_registers_its_command_with_its_handler(module, name, argv, values):
    parser = argparse.ArgumentParser(prog="draftline")
    module.register(parser.add_subparsers(dest="command", required=True))
    assert list(subcommands(parser)) == [name]
    args = parser.parse_args(argv)
    assert args.func is module.handle
    assert {key: getattr(args, key) for key in values} == values


@pytest.mark.parametrize(("module", "name", "argv", "values"), REGISTERED, ids=EXPECTED)
def test_the_full_parser_sends_each_command_to_its_module(module, name, argv, values):
    args = cli.build_parser().parse_args(argv)
    assert args.command == name and args.func is module.handle
    assert {key: getattr(args, key) for key in values} == values


def test_top_level_help_lists_every_command_with_its_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per command: argparse wraps to the terminal's width
    helps = {choice.dest: choice.help for choice in subparsers_of(cli.build_parser())._choices_actions}
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    lines = [line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert [name for name, _ in lines] == EXPECTED
    assert all(text.strip() == helps[name] and text.strip() for name, text in lines)
    assert helps["run"] == "submit a run: prompts → replies → hidden states → drafter → evaluation"


@pytest.mark.parametrize("name", EXPECTED)
def test_each_command_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    assert f"usage: draftline {name}" in capsys.readouterr().out


def test_no_command_or_an_unknown_one_is_a_usage_error(capsys):
    for argv in ([], ["bogus"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
