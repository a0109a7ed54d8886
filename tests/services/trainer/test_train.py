"""The training loop on the tiny target's own data: it learns, it is deterministic, it resumes exactly."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from services.trainer.batching import batch_padding, epoch_order, plan_epoch, plan_padding
from services.trainer.checkpoint import list_checkpoints
from services.trainer.data import Batch, HiddenStateDataset, collate
from modeling.export import export_drafter
from services.trainer.objective import make_targets
from services.trainer.session import prepare
from services.trainer.train import TIMING_FIELDS, TrainProgress, train_drafter
from shared import eagle3
from shared.atomic import TEMP_PREFIX
from shared.layout import RunPaths
from shared.runspec import RunSpec
from runtime.disk import StageHold, disk_status
from shared.lifecycle import Stage
from tests.support.tiny_runs import write_run
from tests.support.tmpfs import fill_volume, mounted_tmpfs


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


def test_an_fp8_run_learns_as_the_target_dtype_run_does(make_run, tiny_model_dir):
    mean = lambda rows, key: sum(r[key] if key == "loss" else r[key][0] for r in rows) / len(rows)  # noqa: E731
    curves = {}
    for storage in ("target", "fp8"):
        paths = make_run(storage, storage=storage, train={"epochs": 30, "save_every": 1000})
        assert train(paths, tiny_model_dir).steps == 120
        curves[storage] = log_records(paths)
    exact, fp8 = curves["target"], curves["fp8"]
    assert mean(fp8[-10:], "loss") < mean(fp8[:5], "loss") - 1.0
    assert mean(fp8[-10:], "acc") > mean(fp8[:5], "acc") + 0.15
    assert fp8[0]["loss"] != exact[0]["loss"]  # the drafter really saw other inputs
    assert abs(mean(fp8[-10:], "loss") - mean(exact[-10:], "loss")) < 0.05 * mean(exact[-10:], "loss")
    assert abs(mean(fp8[-10:], "acc") - mean(exact[-10:], "acc")) < 0.05


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
    drop_time = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
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


# ---- what training reads, and in which order ------------------------------------------------------

def prepared(paths, model_dir):
    return prepare(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=model_dir, device="cpu")


def test_training_reads_every_token_extraction_kept_when_max_length_is_unset(make_run, tiny_model_dir, tiny_samples):
    s = prepared(make_run(), tiny_model_dir)
    assert RunSpec.load(s.paths.data, s.paths.run).train.max_length is None
    assert s.source.max_length == 4096  # extraction.max_length
    assert s.source.lengths == [int(x[eagle3.INPUT_IDS].shape[0]) for x in tiny_samples]


def test_a_smaller_max_length_warns_with_the_stored_loss_tokens_it_drops(make_run, tiny_model_dir, tiny_samples, caplog):
    limit = 50
    cut = [x for x in tiny_samples if x[eagle3.INPUT_IDS].shape[0] > limit]
    dropped = sum(int(x[eagle3.LOSS_MASK][limit:].sum()) for x in cut)
    assert cut and dropped > 0
    with caplog.at_level(logging.WARNING, logger="services.trainer.sources"):
        s = prepared(make_run(train={"max_length": limit}), tiny_model_dir)
    assert s.source.lengths == [min(int(x[eagle3.INPUT_IDS].shape[0]), limit) for x in tiny_samples]
    assert f"{len(cut)} of {len(tiny_samples)} files are cut, and {dropped} stored loss tokens past position {limit}" in caplog.text


@torch.no_grad()
def per_sample_losses(s, plan: list[list[int]]) -> dict[int, tuple[list[float], list[float]]]:
    """Each sample's (ce sums, counts) from the objective, batch by batch as ``plan`` groups them."""
    found = {}
    for indices in plan:
        batch = collate([HiddenStateDataset(s.source.files, s.source.max_length)[i] for i in indices])
        targets = make_targets(batch, s.lm_head, s.drafter.d2t, s.drafter.t2d)
        for row, index in enumerate(indices):  # one row's loss: every other row's mask cleared
            only = torch.zeros_like(batch.loss_mask)
            only[row] = batch.loss_mask[row]
            ce, counts = s.objective(Batch(batch.input_ids, only, batch.aux_hidden, batch.last_hidden, batch.lengths), targets)
            found[index] = (ce.tolist(), counts.tolist())
    return found


def test_each_sample_keeps_its_loss_whatever_batch_the_length_grouped_order_puts_it_in(make_run, tiny_model_dir):
    s = prepared(make_run(train={"batch_size": 1}), tiny_model_dir)
    old = [[i] for i in epoch_order(len(s.source.lengths), s.cfg.seed, 0)]  # the order before length grouping
    assert sorted(s.plans[0]) == sorted(old) and s.source.batching == "length"
    alone = per_sample_losses(s, old)
    assert per_sample_losses(s, s.plans[0]) == alone  # batch_size 1: identical
    grouped = per_sample_losses(s, plan_epoch(s.source.lengths, seed=0, epoch=0, batch_size=4, world=1))  # padded rows
    for index, (ce, counts) in alone.items():
        assert grouped[index][1] == counts
        assert grouped[index][0] == pytest.approx(ce, rel=1e-5)


@pytest.mark.parametrize("train_cfg", [{"max_tokens": 120}, {"group_by_length": False}])
def test_a_run_killed_mid_epoch_resumes_exactly_in_each_batch_order(make_run, tiny_model_dir, train_cfg):
    train_cfg = {"epochs": 3, "save_every": 3, **train_cfg}
    straight = train(make_run("straight", train=train_cfg), tiny_model_dir)
    paths = make_run("killed", train=train_cfg)
    with pytest.raises(Crash):
        train(paths, tiny_model_dir, progress=crash_after(5))
    resumed = train(paths, tiny_model_dir)
    assert resumed.steps == straight.steps and same_weights(resumed.drafter, straight.drafter)
    drop_time = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert drop_time(log_records(paths)) == drop_time(log_records(RunPaths(paths.data, "straight")))


def test_a_checkpoint_from_before_length_grouping_resumes_in_the_order_it_was_made_with(make_run, tiny_model_dir):
    """A run.json written before these settings existed loads with length grouping on; its checkpoints name
    no batching, so the run goes on in the plain shuffle it started in and ends where it would have."""
    train_cfg = {"epochs": 3, "save_every": 3, "group_by_length": False}
    straight = train(make_run("straight", train=train_cfg), tiny_model_dir)
    paths = make_run("old", train=train_cfg)
    with pytest.raises(Crash):
        train(paths, tiny_model_dir, progress=crash_after(5))
    state_file = paths.checkpoint(3) / "state.json"
    state = json.loads(state_file.read_text())
    assert state.pop("batching") == "shuffle"
    state_file.write_text(json.dumps(state))
    spec = json.loads(paths.spec.read_text())
    for key in ("max_tokens", "group_by_length"):
        del spec["train"][key]
    paths.spec.write_text(json.dumps(spec))
    assert RunSpec.load(paths.data, paths.run).train.group_by_length
    resumed = train(paths, tiny_model_dir)
    assert same_weights(resumed.drafter, straight.drafter)


def test_the_log_and_progress_carry_the_padding_of_each_batch_and_epoch(make_run, tiny_model_dir):
    paths = make_run(train={"epochs": 2, "batch_size": 3})
    s = prepared(paths, tiny_model_dir)
    seen = []
    train(paths, tiny_model_dir, progress=seen.append)
    records = log_records(paths)
    plans = [batch for plan in s.plans for batch in plan]
    lengths = s.source.lengths
    assert [r["padding"] for r in records] == [round(batch_padding(b, lengths, 1).fraction, 6) for b in plans]
    assert [p.padding for p in seen] == [plan_padding(s.plans[p.epoch], lengths, 1).fraction for p in seen]
    shuffled = plan_padding(plan_epoch(lengths, seed=0, epoch=0, batch_size=3, world=1, batching="shuffle"), lengths, 1)
    assert seen[0].padding < shuffled.fraction


def test_the_log_splits_each_step_between_its_data_and_the_step_itself(make_run, tiny_model_dir, monkeypatch):
    import time

    from services.trainer.sources import StoredFiles

    paths = make_run(train={"epochs": 2, "batch_size": 3})
    slow = 0.15  # a source that spends this long after each step (an online feed releasing and asking, say)
    after_step = StoredFiles.after_step
    monkeypatch.setattr(StoredFiles, "after_step", lambda self, *a: time.sleep(slow) or after_step(self, *a))
    train(paths, tiny_model_dir)
    records = log_records(paths)
    assert all(r["step_s"] > 0 and r["data_s"] >= 0 for r in records)
    # The source's work after a step counts to the next step's data, across an epoch's end too.
    assert all(r["data_s"] >= slow for r in records[1:])
    # Neither figure counts time twice: together they fit within the loop's time.
    assert sum(r["data_s"] + r["step_s"] for r in records) <= records[-1]["elapsed_s"]


def test_unset_epochs_scale_with_the_data_and_set_ones_are_kept():
    from services.trainer.sources import AUTO_EPOCH_POSITIONS, MAX_AUTO_EPOCHS, MIN_AUTO_EPOCHS, auto_epochs

    assert auto_epochs(3, 10) == 3 and auto_epochs(1, 10**9) == 1  # a set value wins, whatever the data
    assert auto_epochs(None, 1_186_981) == 6  # the 5,000-prompt SmolLM2 run the default was measured on
    assert auto_epochs(None, 2_420_463) == 3  # the quarter ShareGPT capture, where 3 passes beat 2
    # However large the data, at least two passes: the whole ShareGPT capture (10.7M a pass) still gained in its second.
    assert MIN_AUTO_EPOCHS == 2
    assert auto_epochs(None, 10_700_000) == auto_epochs(None, 10 * AUTO_EPOCH_POSITIONS) == MIN_AUTO_EPOCHS
    assert auto_epochs(None, AUTO_EPOCH_POSITIONS) == 2
    assert auto_epochs(None, AUTO_EPOCH_POSITIONS // 2) == 2 and auto_epochs(None, AUTO_EPOCH_POSITIONS // 2 - 1) == 3
    assert auto_epochs(None, AUTO_EPOCH_POSITIONS // 3 - 1) == 4
    assert auto_epochs(None, 1) == auto_epochs(None, 0) == MAX_AUTO_EPOCHS


def test_a_run_with_epochs_unset_trains_the_passes_its_data_calls_for(make_run, tiny_model_dir, tiny_samples, monkeypatch):
    from services.trainer import sources

    positions = sum(int(x[eagle3.INPUT_IDS].shape[0]) for x in tiny_samples)
    monkeypatch.setattr(sources, "AUTO_EPOCH_POSITIONS", 3 * positions - 1)  # three passes' worth
    paths = make_run(train={"epochs": None, "save_every": 1000})
    assert RunSpec.load(paths.data, paths.run).train.epochs is None
    s = prepared(paths, tiny_model_dir)
    assert len(s.plans) == 3 and s.total == sum(len(plan) for plan in s.plans)
    result = train(paths, tiny_model_dir)
    records = log_records(paths)
    assert result.steps == s.total == len(records) and {r["epoch"] for r in records} == {0, 1, 2}


def test_a_checkpoint_that_finds_the_volume_full_waits_for_space_and_training_goes_on(
        tmp_path, redis_conn, make_run, tiny_model_dir, tiny_target, tiny_samples, eval_messages):
    train_cfg = {"epochs": 2, "save_every": 3}  # 4 batches an epoch: checkpoints at 3, 6 and 8
    straight = train(make_run("straight", train=train_cfg), tiny_model_dir)
    with mounted_tmpfs(tmp_path / "volume", 64 << 20) as fs:
        paths = write_run(fs.path, "full", tiny_target, tiny_samples, eval_messages, train=train_cfg)
        neighbour, held = fs.path / "neighbour.bin", []

        class Operator(StageHold):
            """The trainer's hold as status reads it; the operator frees the space once the run says it waits."""

            def hold(self, reason: str) -> None:
                super().hold(reason)
                held.append(disk_status(redis_conn, "full")["held"])
                neighbour.unlink()

        def fill_before_the_checkpoint(p: TrainProgress) -> None:
            if p.step == 3:  # called after step 3's log line, before its checkpoint: room for log lines only
                fill_volume(neighbour, keep=64 << 10)

        result = train(paths, tiny_model_dir, progress=fill_before_the_checkpoint,
                       space_hold=Operator(redis_conn, "full", Stage.TRAIN))
        assert [list(h) for h in held] == [["train"]] and "checkpoint step 3" in held[0]["train"]
        assert disk_status(redis_conn, "full")["held"] == {}  # released once the checkpoint landed
        assert result.steps == straight.steps == 8 and same_weights(result.drafter, straight.drafter)
        assert [step for step, _ in list_checkpoints(paths.checkpoints_dir)] == [6, 8]
        assert [r["step"] for r in log_records(paths)] == list(range(1, 9))
        assert not list(fs.path.rglob(f"{TEMP_PREFIX}*"))
