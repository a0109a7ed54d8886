"""The training loop on the tiny target's own data: it learns, it is deterministic, it resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer.checkpoint import list_checkpoints
from services.trainer.export import export_drafter
from services.trainer.train import TrainProgress, train_drafter
from shared.atomic import TEMP_PREFIX
from shared.layout import RunPaths
from shared.runspec import RunSpec


class Crash(Exception):
    """Stands in for a killed worker: raised from the progress callback after a given step."""


def crash_after(step: int):
    def progress(p: TrainProgress) -> None:
        if p.step == step:
            raise Crash(step)

    return progress


def train(paths, model_dir, **kwargs):
    return train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=model_dir, device="cpu", **kwargs)


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


def same_weights(a, b) -> bool:
    sa, sb = a.export_state(), b.export_state()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loss_falls_and_step_zero_accuracy_rises_on_the_targets_own_replies(make_run, tiny_model_dir):
    paths = make_run(train={"epochs": 30, "save_every": 1000})
    result = train(paths, tiny_model_dir)
    records = log_records(paths)
    assert [r["step"] for r in records] == list(range(1, 121)) and result.steps == 120
    first, last = records[:5], records[-10:]
    mean = lambda rows, key: sum(key(r) for r in rows) / len(rows)  # noqa: E731
    assert mean(last, lambda r: r["loss"]) < mean(first, lambda r: r["loss"]) - 1.0
    assert mean(last, lambda r: r["acc"][0]) > mean(first, lambda r: r["acc"][0]) + 0.15
    assert all(len(r["acc"]) == len(r["loss_k"]) == 3 for r in records)
    assert records[0]["lr"] < records[12]["lr"] and records[-1]["lr"] < records[12]["lr"]  # warmup, then decay


def test_two_runs_with_the_same_seed_train_identical_weights(make_run, tiny_model_dir):
    first = train(make_run("one"), tiny_model_dir)
    second = train(make_run("two"), tiny_model_dir)
    assert same_weights(first.drafter, second.drafter)
    assert torch.equal(first.drafter.d2t, second.drafter.d2t)


def test_a_run_killed_mid_epoch_resumes_to_the_same_weights_and_log(make_run, tiny_model_dir):
    train_cfg = {"epochs": 3, "save_every": 3}  # 4 batches per epoch: checkpoints at 3 (mid-epoch), 6, 9, 12
    straight = train(make_run("straight", train=train_cfg), tiny_model_dir)
    paths = make_run("killed", train=train_cfg)
    with pytest.raises(Crash):
        train(paths, tiny_model_dir, progress=crash_after(5))
    assert [step for step, _ in list_checkpoints(paths.checkpoints_dir)] == [3]
    resumed = train(paths, tiny_model_dir)
    assert resumed.steps == straight.steps == 12
    assert same_weights(resumed.drafter, straight.drafter)
    drop_time = lambda rows: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert drop_time(log_records(paths)) == drop_time(log_records(RunPaths(paths.data, "straight")))


def test_a_finished_run_resumes_to_no_further_steps_and_keeps_two_checkpoints(make_run, tiny_model_dir):
    paths = make_run()
    first = train(paths, tiny_model_dir)
    again = train(paths, tiny_model_dir)
    assert again.steps == first.steps == 8 and same_weights(first.drafter, again.drafter)
    assert [step for step, _ in list_checkpoints(paths.checkpoints_dir)] == [4, 8]
    files = sorted(p.name for p in paths.checkpoint(8).iterdir())
    assert files == ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]  # no pickle
    assert not [p for p in paths.checkpoints_dir.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert len(log_records(paths)) == 8


def test_fine_tuning_keeps_the_base_checkpoints_vocabulary(make_run, tiny_model_dir, tiny_target, data_dir):
    base_run = make_run("base", train={"draft_vocab_size": 128})
    base = train(base_run, tiny_model_dir)
    export_drafter(base.drafter, data_dir / "published" / "drafter", target_model="tiny",
                   target_fingerprint=tiny_target.fingerprint, dtype=torch.float32)
    tuned = train(make_run("tuned", train={"draft_vocab_size": 256, "base_checkpoint": "published/drafter"}), tiny_model_dir)
    assert tuned.drafter.config.draft_vocab_size == 128
    assert torch.equal(tuned.drafter.d2t, base.drafter.d2t) and torch.equal(tuned.drafter.t2d, base.drafter.t2d)
    assert not same_weights(tuned.drafter, base.drafter)  # it trained on from the base weights


@pytest.mark.parametrize(("value", "error", "words"), [
    ("a\x00b", "CheckpointFormatError", "not a usable path"),
    ("b" * 300, "CheckpointFormatError", "not a usable path"),
])
def test_a_hostile_base_checkpoint_fails_by_name_before_training(make_run, tiny_model_dir, value, error, words):
    paths = make_run(train={"base_checkpoint": value})
    with pytest.raises(Exception) as info:
        train(paths, tiny_model_dir)
    assert type(info.value).__name__ == error and words in str(info.value)
    assert not paths.checkpoints_dir.exists() and not paths.train_log.exists()
