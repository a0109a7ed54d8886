"""``draftline serve NAME``: one service in the foreground, as each container runs it."""

from __future__ import annotations

import argparse
import importlib

from shared.services import SERVICE_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run one service in the foreground (what each container runs)")
    serve.add_argument("service", choices=SERVICE_NAMES)
    serve.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    # Imported by name only now, so that a container loads the one service it runs.
    module = importlib.import_module(f"services.{args.service}.main")
    module.main()
    return 0
