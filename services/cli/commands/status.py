"""``draftline status [RUN]``: progress of one run or all, as text, as JSON, or redrawn live (``--watch``)."""

from __future__ import annotations

import argparse
import sys

from services.cli.commands.common import controller_settings, pick_run


def register(subparsers: argparse._SubParsersAction) -> None:
    status = subparsers.add_parser("status", help="progress of one run or all: done/total, errors, rate, ETA, disk")
    status.add_argument("run", nargs="?")
    status.add_argument("--json", action="store_true", help="the same fields as JSON (keys in the README)")
    status.add_argument("--watch", action="store_true", help="redraw live progress bars until the run ends")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between redraws with --watch")
    status.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    from services.controller.runs.status import format_status, list_status, run_status
    from runtime.queues import connect

    settings = controller_settings()
    conn = connect(settings.redis_url)
    if args.watch:
        from services.cli.watch import watch

        run = pick_run(settings.data, args.run)
        try:
            watch(lambda: run_status(settings.data, conn, run), interval_s=args.interval, clear=sys.stdout.isatty())
        except KeyboardInterrupt:
            pass
        return 0
    statuses = [run_status(settings.data, conn, args.run)] if args.run else list_status(settings.data, conn)
    if args.json:
        payload = statuses[0] if args.run else statuses
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    elif not statuses:
        sys.stdout.write("no runs yet: start one with `draftline run --dataset PATH`\n")
    else:
        sys.stdout.write("\n\n".join(format_status(s) for s in statuses) + "\n")
    return 0
