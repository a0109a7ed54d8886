"""Fine-tuning from an earlier draftline export against training from scratch, same data, same steps.

From a finished run's hidden-state files (``--run``) it makes three runs on the same volume, the files
hard-linked, never copied: ``base`` trains on the even sample ids; ``scratch`` and ``tuned`` train on the
odd ones with the same settings and steps, ``tuned`` starting from ``base``'s export (its
``train.base_checkpoint``, checked against the target like any base). Each export is evaluated on the
source run's held-out prompts (drafter curve, the greedy-equality check on), and the figures go to --json.

    python bench/bench_finetune.py --data /tmp/demo-data --run demo-smollm2-... --model-dir /tmp/demo-data/models/smollm2 \
        --json /tmp/finetune.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from services.trainer.data import list_hidden_files  # noqa: E402
from evaluation.evalsets import EvalSet, read_eval_prompts  # noqa: E402
from evaluation.evaluate import evaluate_sets, exported_drafter, load_target, verify_greedy_equality  # noqa: E402
from modeling.export import export_drafter  # noqa: E402
from services.trainer.train import train_drafter  # noqa: E402
from shared.atomic import atomic_write_text  # noqa: E402
from shared.layout import RunPaths  # noqa: E402
from shared.runspec import EvalConfig, RunSpec  # noqa: E402

log = logging.getLogger(__name__)


def make_run(data: Path, source: RunSpec, name: str, parity: int, train: dict[str, Any]) -> RunSpec:
    """A run named ``name`` whose hidden-state files are the source's with sample id % 2 == parity."""
    spec = source.model_copy(update={"name": name, "train": source.train.model_copy(update=train)})
    paths = RunPaths(data, name)
    for sample_id, path in list_hidden_files(RunPaths(data, source.name)):
        if sample_id % 2 == parity:
            target = paths.hidden(sample_id)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.link(path, target)
    spec.save(data)
    return spec


def train_and_export(spec: RunSpec, data: Path, model_dir: Path, device: str) -> tuple[Path, dict[str, Any]]:
    started = time.monotonic()
    result = train_drafter(spec, data=data, model_dir=model_dir, device=device)
    export = RunPaths(data, spec.name).export_dir
    export_drafter(result.drafter, export, target_model=result.target_model, target_fingerprint=result.target_fingerprint)
    last = result.last
    return export, {"steps": result.steps, "files": result.num_files, "seconds": round(time.monotonic() - started, 1),
                    "loss": None if last is None else last.loss, "draft_vocab": result.draft_vocab}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--run", required=True, help="a finished run whose hidden-state files are reused")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    data, source = args.data.resolve(), RunSpec.load(args.data.resolve(), args.run)
    stamp = time.strftime("%H%M%S")
    train = {"save_every": 10_000}
    base = make_run(data, source, f"ft-base-{stamp}", 0, train)
    base_export, base_fig = train_and_export(base, data, args.model_dir, args.device)
    scratch = make_run(data, source, f"ft-scratch-{stamp}", 1, train)
    tuned = make_run(data, source, f"ft-tuned-{stamp}", 1, {**train, "base_checkpoint": str(base_export)})
    figures: dict[str, Any] = {"source_run": source.name, "train": source.train.model_dump(mode="json"),
                               "runs": {"base": base_fig}}
    exports = {"base": base_export}
    for label, spec in (("scratch", scratch), ("tuned", tuned)):
        exports[label], figures["runs"][label] = train_and_export(spec, data, args.model_dir, args.device)

    target, tokenizer = load_target(args.model_dir, torch.device(args.device))
    prompts = read_eval_prompts(RunPaths(data, source.name).eval_prompts)
    cfg = EvalConfig(holdout=len(prompts), max_new_tokens=args.max_new_tokens, draft_steps=3, baselines=False,
                     sets=["holdout"])
    for label, export in exports.items():
        drafter = exported_drafter(target, args.model_dir, export)
        report = evaluate_sets(target, tokenizer, drafter, [EvalSet("holdout", prompts, [])], cfg)
        verify_greedy_equality(report)
        figures["runs"][label]["curve"] = report["methods"]["drafter"]["curve"]
        figures["runs"][label]["greedy_check"] = {k: report["greedy_check"][k] for k in ("checked", "matched")}
    atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
    log.info("%s", json.dumps({k: v.get("curve") for k, v in figures["runs"].items()}))


if __name__ == "__main__":
    main()
