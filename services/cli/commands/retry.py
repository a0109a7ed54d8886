"""``draftline retry [RUN] [IDS...]``: failed samples run again, all errors of the run or the ids named; a run whose
training or evaluation failed, with no sample failure to retry, runs that stage again (training from its checkpoint)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli.commands.common import controller_settings, pick_run
from shared.lifecycle import SAMPLE_STAGES, Stage


def register(subparsers: argparse._SubParsersAction) -> None:
    retry = subparsers.add_parser("retry", help="run failed samples again (all errors of the run, or the ids named), or a failed training from its checkpoint")
    retry.add_argument("run", nargs="?", help="run name (default: the only or latest run)")
    retry.add_argument("ids", nargs="*", type=int, help="sample ids (default: every failure of kind error)")
    retry.add_argument("--stage", choices=[stage.value for stage in SAMPLE_STAGES])
    retry.add_argument("--include-dropped", action="store_true", help="also retry dropped samples")
    retry.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from services.controller.loop.failures import retry_failures
    from runtime.queues import connect

    settings = controller_settings()
    run, ids = args.run, list(args.ids)
    if run is not None and run.isdigit() and not (Path(settings.data) / "runs" / run / "run.json").is_file():
        run, ids = None, [int(run), *ids]  # `draftline retry 5 7`: ids of the only or latest run
    run = pick_run(settings.data, run)
    report = retry_failures(settings.data, connect(settings.redis_url), run, stage=args.stage,
                            sample_ids=ids or None, include_dropped=args.include_dropped)
    if report.resumed is not None:
        sys.stdout.write(resumed_line(run, report.resumed) + "\n")
        return 0
    lines = [f"run {run}: {len(report.cleared):,} failures cleared; the controller enqueues them again"]
    lines += [f"  not retried: {r['stage']} sample {r['sample_id']}: {r['reason']}" for r in report.not_retryable]
    if report.unknown:
        lines.append(f"  no failure record for: {', '.join(map(str, report.unknown))}")
    if report.superseded:
        lines.append(f"  the run had finished: its drafter and evaluation moved to {report.superseded}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if report.cleared else 1


def resumed_line(run: str, resumed: dict) -> str:
    """What ``retry`` says of a failed train or evaluate job it queued again (``RetryReport.resumed``)."""
    step, stage = resumed["checkpoint_step"], Stage(resumed["stage"])
    if step is not None:
        where = f"; training resumes from its checkpoint at step {step}"
    else:
        where = "; training starts over (no checkpoint was written)" if stage is Stage.TRAIN else ""
    return f"run {run}: its failed {stage} job is queued again{where}"
