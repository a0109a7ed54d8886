"""One export measured under each condition in which the trainer's held-out validation and the evaluation
differ, to say which of them makes the two figures differ.

The held-out validation curve (``train.validation_files``) walks the stored replies of files the drafter never
trained on: rows picked by a hash of the sample id, both turns, replies as long as generation let them be,
states as stored (bf16 or fp8). The evaluation decodes the run's held-out rows (the dataset's last valid rows),
first and second turns apart, ``max_new_tokens`` long, with a float32 target. This script decodes first turns
of either row set (``--rows holdout`` or ``--rows validation``: the run's validation files' rows, or as near
as the dataset alone can say: rows that failed in the run are among them) with the target in ``--dtype`` for
``--max-new-tokens``, drafter and prompt lookup, the headline k decoded and the curve by one pass.

    python bench/bench_eval_conditions.py --export /tmp/sg/runs/bench-smollm2-sharegpt-all/drafter/export \\
        --rows validation --prompts 32 --dtype bfloat16 --max-new-tokens 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_export_acceptance import curves, valid_rows  # noqa: E402
from services.cli.target_build import ensure_target  # noqa: E402
from evaluation.evalsets import EvalPrompt, EvalSet, turn_prompts  # noqa: E402
from evaluation.evaluate import evaluate_sets, load_evaluated  # noqa: E402
from services.trainer.validation import validation_split  # noqa: E402
from shared.atomic import atomic_write_text  # noqa: E402
from shared.runspec import EvalConfig  # noqa: E402
from shared.targets import default_target_dir  # noqa: E402

log = logging.getLogger(__name__)


def row_set(dataset: str, holdout: int, validation_files: int, rows: str) -> list[EvalPrompt]:
    """The run's held-out rows (the last ``holdout`` valid rows), or the rows of its validation files: among
    the rest, the ``validation_files`` whose sample ids hash lowest, as ``validation_split`` picks them."""
    valid = list(valid_rows(dataset))
    held, trained = valid[-holdout:], valid[:-holdout]
    if rows == "validation":
        # validation_split picks among (sample id, file) pairs: each row stands in for its file.
        by_file = {Path(str(i)): (i, m) for i, m in trained}
        _, picked = validation_split([(i, file) for file, (i, _) in by_file.items()], validation_files)
        held = [by_file[file] for file in picked]
    return [EvalPrompt(sample_id=i, messages=m) for i, m in held]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--dataset", default="sharegpt", help="the dataset the run read (a path or a packaged name)")
    parser.add_argument("--holdout", type=int, default=256, help="the run's evaluate.holdout")
    parser.add_argument("--validation-files", type=int, default=256, help="the run's train.validation_files")
    parser.add_argument("--rows", choices=("holdout", "validation"), default="holdout")
    parser.add_argument("--prompts", type=int, default=32, help="the first N rows of the set, in sample order")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="the headline k, decoded")
    parser.add_argument("--curve", type=int, default=7, help="k = 1..N (by one pass beside the headline)")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "draftline-export-acceptance")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if not (args.export / "config.json").is_file():
        parser.error(f"--export {args.export}: no exported drafter there (its config.json is missing)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model_dir = ensure_target(args.target, default_target_dir(args.data, args.target))
    prompts = row_set(args.dataset, args.holdout, args.validation_files, args.rows)[: args.prompts]
    cfg = EvalConfig(holdout=args.holdout, max_new_tokens=args.max_new_tokens, draft_steps=args.k,
                     curve_max_steps=args.curve, batch_prompts=len(prompts), decode="headline", sets=["holdout"])
    started = time.monotonic()
    target, tokenizer, drafter = load_evaluated(model_dir, args.export, torch.device(args.device),
                                                getattr(torch, args.dtype))
    report = evaluate_sets(target, tokenizer, drafter, [EvalSet("holdout", turn_prompts(prompts, 1), [])], cfg)
    figures = {"date": time.strftime("%Y-%m-%d"), "export": str(args.export), "rows": args.rows,
               "sample_ids": [p.sample_id for p in prompts], "dtype": args.dtype,
               "max_new_tokens": args.max_new_tokens, "device": args.device, "first_turns": curves(report)["holdout"],
               "seconds": round(time.monotonic() - started, 1)}
    atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
