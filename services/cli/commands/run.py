"""``draftline run``: submit a run, straight through Redis and the volume, or through the controller's API
(``--controller URL``, with the API token); its sections come from the flags over a ``--run-config`` file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli.commands.common import controller_settings
from shared.errors import DraftlineError
from shared.runspec import DEFAULT_SPLIT, SECTIONS


class RunConfigError(DraftlineError):
    """The file given to ``draftline run --run-config`` cannot be read or holds more than run sections."""


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="submit a run: prompts → replies → hidden states → drafter → evaluation")
    run.add_argument("--dataset", required=True, help="JSONL or Parquet file, or a Hugging Face dataset repo id")
    run.add_argument("--name", help="run name (default: derived from the dataset and the time)")
    run.add_argument("--limit", type=int, help="read at most this many rows")
    run.add_argument("--split", default=DEFAULT_SPLIT, help="dataset split for a Hugging Face repo")
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
    run.add_argument("--online", action="store_true", default=None,
                     help="train while extracting, the hidden states bounded by --online-budget (README: online runs)")
    run.add_argument("--online-budget", type=int, metavar="BYTES",
                     help="most bytes of hidden states on the volume at once (default: a quarter of the free space)")
    run.add_argument("--run-config", metavar="FILE",
                     help="a JSON object of the run's generation, extraction, train, evaluate and online sections, as "
                          "POST /runs takes them; the flags above override its values")
    run.add_argument("--force", action="store_true", help="start even when preflight checks fail")
    run.add_argument("--controller", metavar="URL",
                     help="submit through this controller's API (e.g. http://127.0.0.1:8080), sending "
                          "DRAFTLINE_API_TOKEN, instead of through Redis and the volume directly")
    run.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    if args.controller:
        return _run_through_api(args)
    from services.controller.runs.preflight import format_preflight
    from services.controller.runs.served import served_model
    from services.controller.runs.start import PreflightFailed, RunRequest, start_run
    from runtime.queues import connect
    from shared.runspec import EvalConfig, ExtractionConfig, GenerationConfig, OnlineConfig, TrainConfig

    settings = controller_settings()
    generation, extraction, train, evaluate, online = _run_sections(args)
    request = RunRequest(
        dataset=args.dataset, name=args.name, limit=args.limit, split=args.split,
        model=args.model or served_model(settings.inference_url),
        generation=GenerationConfig(**generation), extraction=ExtractionConfig(**extraction),
        train=TrainConfig(**train), evaluate=EvalConfig(**evaluate) if evaluate else None,
        online=OnlineConfig(**online) if online else None,
    )
    try:
        spec, report = start_run(settings, connect(settings.redis_url), request, force=args.force)
    except PreflightFailed as exc:
        sys.stderr.write(format_preflight(exc.report) + "\n")
        return 1
    if report.warnings:
        sys.stderr.write(format_preflight(report) + "\n")
    _submitted(spec.name, spec.rows, spec.train_ids, spec.online.model_dump(), spec.generation.replies)
    return 0


def run_config(path: str | None) -> dict[str, dict]:
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
    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise RunConfigError(f"run config {path}: unknown section(s) {', '.join(unknown)}; "
                             f"it may hold {', '.join(SECTIONS)}")
    wrong = sorted(name for name, section in config.items() if not isinstance(section, dict))
    if wrong:
        raise RunConfigError(f"run config {path}: section(s) {', '.join(wrong)} must be JSON objects")
    return config


def _run_sections(args: argparse.Namespace) -> tuple[dict, dict, dict, dict, dict]:
    """The generation, extraction, train, evaluate and online settings: the ``--run-config`` file's, then the
    command line's flags over them (the rest take defaults)."""
    generation = {"max_tokens": args.max_tokens, "min_completion_tokens": args.min_completion_tokens,
                  "temperature": args.temperature}
    extraction = {"storage": args.hidden_storage}
    train = {"epochs": args.epochs, "ttt_steps": args.ttt_steps, "draft_vocab_size": args.draft_vocab_size,
             "base_checkpoint": args.base_checkpoint}
    evaluate = {"holdout": args.holdout}
    online = {"enabled": args.online or (True if args.online_budget is not None else None),
              "budget_bytes": args.online_budget}
    config = run_config(getattr(args, "run_config", None))
    return tuple({**config.get(name, {}), **{k: v for k, v in section.items() if v is not None}}
                 for name, section in zip(SECTIONS, (generation, extraction, train, evaluate, online)))


def _run_through_api(args: argparse.Namespace) -> int:
    """``draftline run --controller URL``: the same run through ``POST /runs``, with the API token."""
    from services.cli.api import ControllerClient, ControllerRefused

    sections = _run_sections(args)
    body = {"dataset": args.dataset, "name": args.name, "limit": args.limit, "split": args.split, "model": args.model,
            **{name: section or None for name, section in zip(SECTIONS, sections)},
            "force": args.force}
    token = controller_settings().api_token
    with ControllerClient(args.controller, token=token.get_secret_value() if token else None) as client:
        try:
            spec = client.submit({k: v for k, v in body.items() if v is not None})
        except ControllerRefused as exc:
            if exc.status != 412:
                raise
            sys.stderr.write(_refused_preflight(exc.detail) + "\n")
            return 1
    _submitted(spec["name"], spec["rows"], spec["train_ids"], spec.get("online") or {},
               (spec.get("generation") or {}).get("replies", 1))
    return 0


def _refused_preflight(detail: object) -> str:
    """The controller's 412: its message, then each failed check with its fix."""
    from services.controller.runs.preflight import FAILED_CHECKS

    if not isinstance(detail, dict):
        return f"preflight failed: {detail}"
    lines = [str(detail.get("message", "preflight failed"))]
    for check in detail.get(FAILED_CHECKS, []):
        lines.append(f"  [FAIL] {check.get('name', '?'):<26} {check.get('message', '')}")
        if check.get("fix"):
            lines.append(f"         {'':<26} fix: {check['fix']}")
    return "\n".join(lines)


def _submitted(name: str, rows: int, train_ids: int, online: dict, replies: int = 1) -> None:
    """What the run took on: the rows read (``rows`` counts the sample ids, sampled replies' included) and the
    sample ids queued."""
    from runtime.disk import format_bytes

    read = rows - (replies - 1) * (train_ids // replies)
    sampled = f" ({replies} replies per training prompt)" if replies > 1 else ""
    sys.stdout.write(f"run {name}: {read} rows read, {train_ids} sample ids queued for generation{sampled}\n")
    if online.get("enabled"):
        sys.stdout.write(f"online: hidden states bounded by {format_bytes(online['budget_bytes'])} "
                         f"({online['budget_bytes']:,} bytes); training starts once generation has settled\n")
    sys.stdout.write(f"follow it with: draftline status {name}\n")
