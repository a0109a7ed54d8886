"""How much of the text a drafter must predict a draft vocabulary of each size can hold at all.

A drafter proposes only draft-vocabulary tokens, so a reply token outside the vocabulary is never accepted.
For each ``--sizes`` N the vocabulary is the trainer's own choice (services/trainer/vocab.py: the N ids most
often loss-masked in the training files) and the figure is the share of held-out tokens inside it: a ceiling
on the per-token acceptance, before any training, that bounds what a smaller vocabulary can cost.

Two sources of tokens:
- ``--data DIR --run RUN``: a run's hidden-state files, the real thing: the target's own replies, counted at
  their loss-masked positions, the held-out part being the files ``train.validation_files`` holds out
  (``validation_split``; ``--validation-files`` when the run set none).
- ``--dataset NAME``: a dataset's replies as written (to each conversation's first ``--turns`` user turns),
  tokenized by the target's tokenizer, the held-out part being the evaluation's held-out rows (the last
  ``--holdout`` valid rows), first and second replies apart. A stand-in where no run's files are at hand: another model wrote the text.

    python bench/bench_draft_vocab.py --target /tmp/target --dataset sharegpt --json vocab.json
    python bench/bench_draft_vocab.py --target /tmp/draftline-bench/data/models/smollm2 \\
        --data /tmp/draftline-bench/data --run bench-smollm2-sharegpt-all --json vocab.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.bench_export_acceptance import valid_rows  # noqa: E402
from services.trainer.data import list_hidden_files  # noqa: E402
from services.trainer.validation import validation_split  # noqa: E402
from services.trainer.vocab import build_mapping, count_tokens  # noqa: E402
from shared.atomic import atomic_write_text  # noqa: E402
from shared.layout import RunPaths  # noqa: E402
from shared.runspec import RunSpec  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_SIZES = (4000, 8000, 16000, 24000, 32000)


def coverage(train_counts: torch.Tensor, held_counts: dict[str, torch.Tensor], sizes: Sequence[int]) -> list[dict]:
    """Per size: the training tokens and each held-out part's tokens that the trainer's vocabulary of that
    size (built from ``train_counts``) holds, as shares, and the held-out tokens it misses per 1,000."""
    rows = []
    for size in sizes:
        _, t2d = build_mapping(train_counts, size)
        row: dict[str, Any] = {"size": int(t2d.sum()), "train": share(train_counts, t2d)}
        for part, counts in held_counts.items():
            row[part] = share(counts, t2d)
            row[f"{part}_missed_per_1000"] = round(1000 * (1 - row[part]), 2)
        rows.append(row)
    return rows


def share(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    total = int(counts.sum())
    return round(int(counts[t2d].sum()) / total, 6) if total else 0.0


def token_counts(id_lists: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in id_lists:
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


Counts = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]


def from_files(data: Path, run: str, target: Path, validation_files: int | None) -> Counts:
    """Counts over a run's hidden-state files: its training files, and the files its validation holds out."""
    spec = RunSpec.load(data, run)
    count = spec.train.validation_files if validation_files is None else validation_files
    if not count:
        raise SystemExit(f"run {run} holds no validation files out: pass --validation-files N")
    files = list_hidden_files(RunPaths(data, run))
    trained, held = validation_split(files, count)
    vocab_size = target_vocab_size(target)
    max_length = spec.train_max_length
    facts = {"source": "files", "run": run, "train_files": len(trained), "held_out_files": len(held),
             "target_vocab": vocab_size}
    return (count_tokens(trained, vocab_size, max_length),
            {"held_out": count_tokens(held, vocab_size, max_length)}, facts)


def target_vocab_size(target: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(target).vocab_size)


def from_dataset(dataset: str, target: Path, holdout: int, turns: int) -> Counts:
    """Counts over a dataset's replies as written, to each conversation's first ``turns`` user turns (the
    benchmark's generation.max_turns): every valid row but the last ``holdout`` (the evaluation's held-out
    rows), and those rows' first and second replies apart."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    vocab_size = target_vocab_size(target)
    rows = list(valid_rows(dataset, with_replies=True))
    trained, held = rows[:-holdout], rows[-holdout:]

    def ids(messages: list[dict], turn: slice) -> list[list[int]]:
        return [tokenizer.encode(text, add_special_tokens=False) for text in replies(messages)[:turns][turn]]

    train = token_counts((one for _, m in trained for one in ids(m, slice(None))), vocab_size)
    first = token_counts((one for _, m in held for one in ids(m, slice(0, 1))), vocab_size)
    second = token_counts((one for _, m in held for one in ids(m, slice(1, 2))), vocab_size)
    facts = {"source": "dataset", "dataset": dataset, "turns": turns, "train_rows": len(trained),
             "held_out_rows": len(held), "target_vocab": vocab_size}
    return train, {"held_out_turn1": first, "held_out_turn2": second}, facts


def replies(messages: list[dict]) -> list[str]:
    """The dataset's reply to each user turn, in order: the first assistant message after it (assistant
    messages before the first user turn answer nothing, as in the regeneration)."""
    out, asked = [], False
    for message in messages:
        if message["role"] == "user":
            asked = True
        elif message["role"] == "assistant" and asked:
            out.append(message["content"])
            asked = False
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target's model directory (its tokenizer, "
                        "its vocabulary size)")
    parser.add_argument("--data", type=Path, help="the volume holding --run")
    parser.add_argument("--run", help="a run whose hidden-state files to count")
    parser.add_argument("--validation-files", type=int, help="files held out (default: the run's train.validation_files)")
    parser.add_argument("--dataset", help="a dataset whose assistant messages to count (a path or a packaged name)")
    parser.add_argument("--holdout", type=int, default=256, help="the evaluation's held-out rows, for --dataset")
    parser.add_argument("--turns", type=int, default=2, help="replies counted per conversation, for --dataset "
                        "(the benchmark's generation.max_turns)")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="draft vocabulary sizes")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if (args.run is None) == (args.dataset is None):
        parser.error("give --data and --run, or --dataset")
    if args.run is not None:
        if args.data is None:
            parser.error("--run needs --data")
        train, held, facts = from_files(args.data, args.run, args.target, args.validation_files)
    else:
        train, held, facts = from_dataset(args.dataset, args.target, args.holdout, args.turns)
    sizes = [int(size) for size in args.sizes.split(",")]
    facts.update(distinct_train_ids=int((train > 0).sum()), train_tokens=int(train.sum()), **{f"{part}_tokens": int(c.sum()) for part, c in held.items()},
                 coverage=coverage(train, held, sizes))
    atomic_write_text(args.json, json.dumps(facts, indent=2) + "\n")
    for row in facts["coverage"]:
        log.info("draft vocabulary %d: %s", row["size"],
                 ", ".join(f"{part} {100 * row[part]:.2f}%" for part in ("train", *held)))


if __name__ == "__main__":
    main()
