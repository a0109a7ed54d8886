"""The whole pipeline on a real target, measured: data size, time per stage, training curve, and the
acceptance curve 1..7 per evaluation set next to both baselines measured in the same run.

It runs exactly what ``make demo`` runs (services.cli.pipeline: every service as a local process, a run
submitted through the controller's API) with a bigger run: N training prompts from
bench/offline_prompts.py (the standard library's documentation, never an evaluation prompt), the run's
held-out rows and HumanEval as evaluation sets. Results go to --json; bench/RESULTS.md and
bench/results.json are written from it by hand, with the command.

    python bench/bench_pipeline.py --data /tmp/bench-data --prompts 5000 --device cuda --json out.json
    python bench/bench_pipeline.py --data /tmp/bench-data --prompts 5000 --inference-replicas 8 --generators 8 --json out.json
    python bench/bench_pipeline.py --data /tmp/bench-data --prompts 40 --target tiny --small --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_prompts import prompts as offline_prompts  # noqa: E402

from services.cli.pipeline import PipelineSpec, run_pipeline, say, stage_table  # noqa: E402
from services.inference.targets import ensure_target  # noqa: E402
from shared.atomic import atomic_write_text, read_json  # noqa: E402
from shared.layout import RunPaths  # noqa: E402
from shared.targets import default_target_dir  # noqa: E402

log = logging.getLogger(__name__)

# One H200: batches as large as a 135M target decodes well, long enough replies to learn from, and every
# evaluation prompt of a set decoded as one batch (a pass costs about the same for one row as for 256).
GPU_RUN: dict[str, Any] = {
    "generation": {"max_tokens": 256, "min_completion_tokens": 16, "temperature": 0.0},
    "train": {"epochs": 6, "batch_size": 16, "lr": 5e-4, "ttt_steps": 7, "draft_vocab_size": 32000,
              "save_every": 500},
    "evaluate": {"holdout": 64, "max_new_tokens": 128, "draft_steps": 3, "curve_max_steps": 7, "batch_prompts": 256},
}
# 4 generators x 64 requests in flight into one inference server: processes sharing one GPU time-slice it
# (4 servers gave 6.6 samples/s where 1 gave 5.5, both while cuDNN attention re-planned every step).
GPU_ENV = {"DRAFTLINE_DEVICE": "cuda", "DRAFTLINE_MAX_BATCH_SIZE": "256", "DRAFTLINE_BATCH_WAIT_MS": "50",
           "DRAFTLINE_CONCURRENCY": "64", "DRAFTLINE_GENERATE_BATCH": "64", "DRAFTLINE_EVAL_PROCS": "1"}
GPU_REPLICAS = {"inference": 1, "generator": 4, "extractor": 2}
# The same run with a shorter evaluation (the first 48 HumanEval prompts, 32 held out, 64 new tokens): a
# pipeline check on the GPU when device time is short (--quick-eval).
QUICK_EVAL = {"holdout": 32, "max_new_tokens": 64, "draft_steps": 3, "curve_max_steps": 7, "humaneval_limit": 48,
              "batch_prompts": 256}
SMALL_REPLICAS = {"inference": 1, "generator": 1, "extractor": 1}
# A few minutes on a CPU: proves the benchmark runs end to end (tests run it this way too).
SMALL_RUN: dict[str, Any] = {
    "generation": {"max_tokens": 24, "min_completion_tokens": 4, "temperature": 0.0},
    "train": {"epochs": 1, "batch_size": 8, "lr": 1e-3, "ttt_steps": 2, "draft_vocab_size": 256, "save_every": 50},
    "evaluate": {"holdout": 2, "max_new_tokens": 8, "draft_steps": 2, "humaneval_limit": 2, "curve_max_steps": 2},
}


def write_dataset(data: Path, count: int, holdout: int) -> Path:
    path = data / "datasets" / f"offline-{count}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = offline_prompts(count + holdout)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def training_curve(paths: RunPaths, points: int = 20) -> list[dict[str, Any]]:
    """About ``points`` evenly spaced steps of the train log (step, epoch, loss, accuracy per TTT step, lr,
    seconds since the start)."""
    log_path = paths.train_log
    if not log_path.is_file():
        return []
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    every = max(1, len(rows) // points)
    keep = ("step", "epoch", "loss", "acc", "lr", "elapsed_s", "padding")
    return [{k: row[k] for k in keep if k in row} for row in rows[::every] + rows[-1:]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=5000, help="training prompts (held-out rows come on top)")
    parser.add_argument("--target", default="smollm2", choices=("smollm2", "tiny"))
    parser.add_argument("--model-dir", type=Path, help="an existing target directory instead of --target's")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="the CPU-sized run (a check that it runs)")
    parser.add_argument("--quick-eval", action="store_true", help="the GPU run with a shorter evaluation")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--inference-replicas", type=positive_int, metavar="N",
                        help=f"inference server processes, all on the same device (default {GPU_REPLICAS['inference']} "
                        f"for the GPU run, {SMALL_REPLICAS['inference']} for --small or --device cpu)")
    parser.add_argument("--generators", type=positive_int, metavar="N",
                        help=f"generator workers (default {GPU_REPLICAS['generator']}; 1 for --small or --device cpu)")
    parser.add_argument("--extractors", type=positive_int, metavar="N",
                        help=f"extractor workers (default {GPU_REPLICAS['extractor']}; 1 for --small or --device cpu)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per status poll drowns the progress

    run = SMALL_RUN if args.small else {**GPU_RUN, "evaluate": QUICK_EVAL} if args.quick_eval else GPU_RUN
    env = dict(GPU_ENV) if args.device == "cuda" else {"DRAFTLINE_DEVICE": "cpu"}
    data = args.data.resolve()
    started = time.monotonic()
    model_dir = args.model_dir or ensure_target(args.target, default_target_dir(data, args.target))
    prepared = round(time.monotonic() - started, 1)
    dataset = write_dataset(data, args.prompts, run["evaluate"]["holdout"])
    spec = PipelineSpec(data=data, model_dir=model_dir, dataset=dataset, run=run, timeout_s=args.timeout,
                        name=f"bench-{args.target}-{args.prompts}", env=env, replicas=replicas_of(args))
    result = run_pipeline(spec)
    paths = RunPaths(data, spec.name)
    evaluation = read_json(paths.eval_report)
    stages = result.status["stages"]
    figures = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "device": device_name(args.device),
        "target": args.target if args.model_dir is None else str(args.model_dir),
        "training_prompts": args.prompts,
        "run": run,
        "env": env,
        "replicas": spec.replicas,
        "samples": {"generated": stages["generate"]["done"], "extracted": stages["extract"]["done"],
                    "failed": result.status["errors"]["total"], "dropped": result.status["errors"]["dropped"]},
        "hidden_bytes": result.status["disk"]["run_bytes"],
        "target_ready_s": prepared,
        "stage_seconds": result.stage_seconds,
        "wall_seconds": result.wall_seconds,
        "train_loss": stages["train"]["loss"],
        "training_curve": training_curve(paths),
        "evaluation": summary(evaluation),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
    for line in stage_table(result):
        say(line)
    say(json.dumps(figures["evaluation"], indent=2))


def replicas_of(args: argparse.Namespace) -> dict[str, int]:
    """Processes per service: the GPU run's defaults or the small run's, each overridden by its option."""
    replicas = dict(GPU_REPLICAS if args.device == "cuda" and not args.small else SMALL_REPLICAS)
    for service, option in (("inference", args.inference_replicas), ("generator", args.generators),
                            ("extractor", args.extractors)):
        if option is not None:
            replicas[service] = option
    return replicas


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def summary(evaluation: dict[str, Any]) -> dict[str, Any]:
    """Per set: prompts, greedy check, and each method's curve (the per-prompt rows stay in eval.json)."""
    out = {}
    for name, one in evaluation.get("sets", {}).items():
        out[name] = {"prompts": len(one["prompts"]), "greedy_check": one["greedy_check"], "seconds": one["seconds"],
                     "headline": {"draft_steps": one["draft_steps"], "acceptance_length": one["acceptance_length"]},
                     **{method: {"curve": m["curve"]} if "curve" in m else {"acceptance_length": m["acceptance_length"]}
                        for method, m in one["methods"].items()}}
    return out


def device_name(device: str) -> str:
    if device != "cuda":
        return platform.processor() or "cpu"
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    main()
