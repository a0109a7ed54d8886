"""The row sets the condition benchmark decodes: the run's held-out rows, or its validation files' rows, as
the controller and the trainer pick them (the decoding itself is the evaluator's, tested with it)."""

from __future__ import annotations

from pathlib import Path

from bench.bench_eval_conditions import row_set
from services.trainer.validation import validation_split
from tests.services.controller.runs.test_datasets import write_jsonl


def test_held_out_rows_are_the_last_valid_ones_and_validation_rows_are_the_trainers_pick(tmp_path):
    rows = [{"prompt": f"q{i}"} for i in range(40)]
    rows[37] = "{bad"  # a malformed row is not a valid row: the held-out rows are the last valid ones
    dataset = str(write_jsonl(tmp_path / "d.jsonl", rows))
    held = row_set(dataset, 4, 5, "holdout")
    assert [p.sample_id for p in held] == [35, 36, 38, 39]
    assert held[0].messages == [{"role": "user", "content": "q35"}]
    picked = row_set(dataset, 4, 5, "validation")
    trained_ids = [i for i in range(40) if i not in (35, 36, 37, 38, 39)]
    _, expected = validation_split([(i, Path(f"{i:08d}.safetensors")) for i in trained_ids], 5)
    assert [p.sample_id for p in picked] == [int(path.stem) for path in expected]
    assert len(picked) == 5 and not {p.sample_id for p in picked} & {35, 36, 38, 39}
    assert picked[0].messages == [{"role": "user", "content": f"q{picked[0].sample_id}"}]
