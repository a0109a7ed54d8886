"""``draftline resume [RUN]``: a run's state rebuilt from the volume, after a crash or a lost Redis."""

from __future__ import annotations

import argparse
import sys

from services.cli.commands.common import controller_settings, pick_run


def register(subparsers: argparse._SubParsersAction) -> None:
    resume = subparsers.add_parser("resume", help="rebuild a run's state from the volume (after a crash or a lost "
                                                  "Redis)")
    resume.add_argument("run", nargs="?", help="run name (default: the only or latest run)")
    resume.add_argument("--deep", action="store_true", help="read every hidden-state file in full (checksums)")
    resume.add_argument("--json", action="store_true")
    resume.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    import json

    from services.controller.loop.reconcile import reconcile_run
    from runtime.queues import connect

    settings = controller_settings()
    run = pick_run(settings.data, args.run)
    report = reconcile_run(settings.data, connect(settings.redis_url), run, deep=args.deep)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n")
        return 0
    lines = [f"run {run}: resumed ({'deep' if report.deep else 'quick'} check), state {report.state}",
             f"  verified  {report.generated:,} replies, {report.extracted:,} hidden-state files "
             f"({report.adopted:,} adopted into the manifest) of {report.expected:,} samples",
             f"  redone    {len(report.redone):,} files removed to be made again",
             *[f"    {r['stage']:<8} sample {r['sample_id']:<8} {r['reason']}" for r in report.redone[:50]],
             f"  cleaned   {report.temp_removed:,} leftover temp files, "
             f"{report.failures_cleared:,} stale failure records",
             f"  failures  {report.failures_kept:,} kept (draftline failures {run})"]
    if report.named:
        lines.append(f"  named     {len(report.named):,} rows missing from the prompts: {report.named[:20]}")
    if report.registered:
        lines.append("  redis     had lost this run; registered again from the volume")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
