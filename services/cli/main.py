"""``draftline``: one console script; each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

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
from shared.errors import DraftlineError
from shared.settings import configure_logging

log = logging.getLogger("draftline")

# Every subcommand's module (services/cli/commands/), in the order `draftline --help` lists them. Listed by
# hand, not discovered: a command exists when it is named here, and this line shows them all.
COMMANDS: tuple[ModuleType, ...] = (serve, make_tiny_model, make_target, run, worker_health, preflight, status,
                                    resume, failures, retry, retrain, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DraftlineError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
