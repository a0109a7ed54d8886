"""An exported drafter measured away from the run that trained it: the evaluator's acceptance curve (with
prompt lookup and no drafter beside it) on a dataset's held-out conversations, and, with ``--vllm-prompts``,
vLLM's own acceptance for the same export on the first of those prompts, counted by its ``/metrics``.

It serves an export that came back from the GPU machine (bench/gpu_pipeline.sh brings ``export.tgz`` parts)
to the CPU vLLM here. The held-out conversations are the ones the run held out, found by the controller's
rule (services/controller/runs/submit.py: the last ``--holdout`` valid rows of the rows read), so none of them
was trained on; ``--prompts`` takes the first N of them.

    python bench/bench_export_acceptance.py --export /tmp/sg/runs/bench-smollm2-sharegpt-all/drafter/export \\
        --dataset sharegpt --holdout 256 --prompts 32 --vllm-prompts 16 --json /tmp/sg/acceptance.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from services.cli.demo import VLLM_CPU_ARGS, installed_vllm_cpu  # noqa: E402
from services.controller.runs.datasets import PACKAGED, iter_rows, packaged_dataset  # noqa: E402
from services.controller.runs.submit import prompt_line  # noqa: E402
from services.cli.target_build import ensure_target  # noqa: E402
from evaluation.engine_acceptance import EngineLaunch, measure_export  # noqa: E402
from evaluation.evalsets import EvalSet, read_eval_prompts, turn_prompts  # noqa: E402
from evaluation.evaluate import evaluate_sets, load_evaluated, prompt_ids_of  # noqa: E402
from evaluation.vllm_launch import python_command  # noqa: E402
from shared.atomic import atomic_write_text  # noqa: E402
from shared.errors import RowError  # noqa: E402
from shared.runspec import EvalConfig  # noqa: E402
from shared.settings import TrainerSettings  # noqa: E402
from shared.targets import default_target_dir  # noqa: E402

log = logging.getLogger(__name__)

# The evaluate job's own default for how far vLLM may lie from the evaluator.
TOLERANCE = TrainerSettings.model_fields["eval_vllm_tolerance"].default


def valid_rows(dataset: str, *, with_replies: bool = False) -> Iterator[tuple[int, list[dict]]]:
    """``(sample_id, messages)`` of every row the controller would take (a path or a packaged name); with
    ``with_replies``, each row's messages as written, its last replies kept."""
    source = packaged_dataset(dataset) if dataset in PACKAGED else dataset
    for sample_id, item in iter_rows(source, with_replies=with_replies):
        if not isinstance(item, RowError):
            yield sample_id, item


def held_out(dataset: str, holdout: int, path: Path) -> None:
    """The run's held-out conversations as ``eval_prompts.jsonl``: the last ``holdout`` valid rows."""
    kept = deque(valid_rows(dataset), maxlen=holdout)
    path.write_bytes(b"".join(prompt_line(i, m) for i, m in kept))


def curves(report: dict[str, Any]) -> dict[str, Any]:
    """Per set: prompts measured and left out, and each method's curve."""
    out = {}
    for name, one in report["sets"].items():
        methods = one["methods"]
        out[name] = {"prompts": len(one["prompts"]), "too_long": len(one["too_long"]),
                     "greedy_checked": one["greedy_check"]["checked"], "greedy_matched": one["greedy_check"]["matched"],
                     "seconds": round(one["seconds"], 1), "drafter": methods["drafter"]["curve"],
                     "lookup": methods.get("lookup", {}).get("curve"), "over_lookup": one.get("over_lookup", {}),
                     "no_drafter": methods.get("no_drafter", {}).get("acceptance_length")}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--dataset", default="sharegpt", help="the dataset the run read (a path or a packaged name)")
    parser.add_argument("--holdout", type=int, default=256, help="the run's evaluate.holdout")
    parser.add_argument("--prompts", type=int, default=32, help="the first N held-out conversations")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "draftline-export-acceptance")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--curve", type=int, default=7, help="k = 1..N")
    parser.add_argument("--k", type=int, default=3, help="the headline k, which vLLM serves")
    parser.add_argument("--sets", default="holdout,holdout_turn2")
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--vllm-prompts", type=int, default=0, help="of the first set, served by the CPU vLLM")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if not (args.export / "config.json").is_file():
        parser.error(f"--export {args.export}: no exported drafter there (its config.json is missing)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    args.data.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or ensure_target(args.target, default_target_dir(args.data, args.target))
    eval_prompts = args.data / "eval_prompts.jsonl"
    held_out(args.dataset, args.holdout, eval_prompts)
    held = read_eval_prompts(eval_prompts)[: args.prompts]
    cfg = EvalConfig(holdout=args.holdout, max_new_tokens=args.max_new_tokens, draft_steps=args.k,
                     curve_max_steps=args.curve, batch_prompts=args.batch_prompts, sets=args.sets.split(","))
    sets = [EvalSet(name, turn_prompts(held, 1 if name == "holdout" else 2), []) for name in cfg.sets]
    started = time.monotonic()
    target, tokenizer, drafter = load_evaluated(model_dir, args.export, torch.device(args.device), torch.float32)
    report = evaluate_sets(target, tokenizer, drafter, sets, cfg)
    figures: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "export": str(args.export), "device": args.device,
                               "held_out_conversations": len(held), "evaluate": cfg.model_dump(mode="json"),
                               "sets": curves(report), "evaluate_s": round(time.monotonic() - started, 1)}
    atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
    if args.vllm_prompts:
        python = installed_vllm_cpu()
        if python is None:
            raise SystemExit("no CPU vLLM here: run tools/vllm_cpu.sh first")
        headline = report["sets"][report["headline_set"]]
        measured_ids = {row["sample_id"] for row in headline["prompts"]}
        first = next(one for one in sets if one.name == report["headline_set"])
        asked = [p for p in first.prompts if p.sample_id in measured_ids][: args.vllm_prompts]
        launch = EngineLaunch(python_command(python), model_dir, args.data / "vllm.log",
                              engine_args=shlex.split(VLLM_CPU_ARGS))
        figures["engine"] = measure_export(launch, args.export, report,
                                           [(p.sample_id, prompt_ids_of(tokenizer, p)) for p in asked],
                                           tolerance=TOLERANCE)
        atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
