"""``draftline failures [RUN]``: every failed or dropped sample of a run, with its error."""

from __future__ import annotations

import argparse
import sys

from services.cli.commands.common import controller_settings, pick_run
from shared.lifecycle import SAMPLE_STAGES


def register(subparsers: argparse._SubParsersAction) -> None:
    failures = subparsers.add_parser("failures", help="every failed or dropped sample of a run, with its error")
    failures.add_argument("run", nargs="?", help="run name (default: the only or latest run)")
    failures.add_argument("--stage", choices=[stage.value for stage in SAMPLE_STAGES])
    failures.add_argument("--json", action="store_true")
    failures.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    from services.controller.loop.failures import failure_dict, format_failures, list_failures

    settings = controller_settings()
    run = pick_run(settings.data, args.run)
    failures = list_failures(settings.data, run, stage=args.stage)
    if args.json:
        sys.stdout.write(json.dumps([failure_dict(f) for f in failures], indent=2) + "\n")
    else:
        sys.stdout.write(format_failures(run, failures) + "\n")
    return 0
