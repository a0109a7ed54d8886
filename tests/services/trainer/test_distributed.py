"""Data-parallel training: two real torchrun processes over gloo take the steps one process takes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.trainer.checkpoint import latest_checkpoint
from services.trainer.export import export_drafter
from services.trainer.launch import run_torchrun
from services.trainer.train import (
    is_filler,
    rank_batches,
    resume,
    train_drafter,
    trained_from_checkpoint,
)
from shared.errors import CheckpointFormatError
from shared.runspec import RunSpec
from shared.settings import TrainerSettings, load_settings
from tests.services.trainer.conftest import write_run

# 13 samples in global batches of 4: three full batches and a one-sample tail, which leaves rank 1 of two
# with a stand-in sample that must add nothing.
SAMPLES = 13
TRAIN = {"epochs": 2, "ttt_steps": 2, "save_every": 100}

# Two processes sum each step's gradients in another order than one process (two partial sums, then an
# all-reduce, over batches padded to other widths), so float32 results differ in the last bits: measured
# here, at most 2.5e-6 in any weight and 1e-6 in any step's loss. A mean per rank instead of over the
# global batch (the mistake this guards against) moves weights by 1.5e-3 to 1.8e-2 on these samples.
ATOL, RTOL = 2e-5, 1e-4


def unequal(samples: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Samples cut by 0, 6, 12 and 18 tokens in turn: ranks then hold different loss-token counts."""
    cut = lambda sample, drop: {k: v[: v.shape[0] - drop].contiguous() for k, v in sample.items()}
    return [cut(sample, (i % 4) * 6) for i, sample in enumerate(samples)]


def settings_for(data_dir, model_dir, redis_url) -> TrainerSettings:
    return load_settings(TrainerSettings, data=data_dir, model_dir=model_dir, device="cpu", redis_url=redis_url)


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


def test_rank_shares_cover_each_global_batch_once_and_only_the_tail_has_stand_ins() -> None:
    order = list(range(SAMPLES))
    shares = [rank_batches(order, 2, rank, 2) for rank in range(2)]
    assert len(shares[0]) == len(shares[1]) == 4  # every rank takes every step
    for index in range(4):
        real = [i for rank in range(2) if not is_filler(SAMPLES, 2, rank, 2, index) for i in shares[rank][index]]
        assert sorted(real) == order[index * 4 : index * 4 + 4]
    assert [is_filler(SAMPLES, 2, 1, 2, i) for i in range(4)] == [False, False, False, True]
    assert not any(is_filler(SAMPLES, 4, 0, 1, i) for i in range(4))


def test_two_gloo_processes_train_what_one_process_trains_on_the_same_global_batches(
    data_dir, tiny_target, tiny_samples, eval_messages, tiny_model_dir, redis_url,
):
    samples = unequal(tiny_samples[:SAMPLES])
    one = write_run(data_dir, "one", tiny_target, samples, eval_messages, train={**TRAIN, "batch_size": 4})
    two = write_run(data_dir, "two", tiny_target, samples, eval_messages, train={**TRAIN, "batch_size": 2})
    single = train_drafter(RunSpec.load(data_dir, "one"), data=data_dir, model_dir=tiny_model_dir, device="cpu")

    run_torchrun("two", 2, settings_for(data_dir, tiny_model_dir, redis_url))
    double = trained_from_checkpoint(RunSpec.load(data_dir, "two"), data=data_dir, model_dir=tiny_model_dir)

    assert double.steps == single.steps == 8
    assert json.loads((latest_checkpoint(two.checkpoints_dir) / "state.json").read_text())["world_size"] == 2
    a, b = single.drafter.export_state(), double.drafter.export_state()
    assert a.keys() == b.keys()
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    first, second = log_records(one), log_records(two)
    assert [r["step"] for r in second] == [r["step"] for r in first]
    for r1, r2 in zip(first, second, strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=RTOL, abs=ATOL)  # the global batch's loss, not rank 0's
        assert r2["lr"] == pytest.approx(r1["lr"])


def test_the_export_from_the_last_checkpoint_equals_the_export_of_the_trained_drafter(make_run, tiny_model_dir, data_dir):
    paths = make_run(train=TRAIN)
    spec = RunSpec.load(data_dir, paths.run)
    trained = train_drafter(spec, data=data_dir, model_dir=tiny_model_dir, device="cpu")
    rebuilt = trained_from_checkpoint(spec, data=data_dir, model_dir=tiny_model_dir)
    assert (rebuilt.steps, rebuilt.target_model, rebuilt.target_fingerprint, rebuilt.layer_ids) == (
        trained.steps, trained.target_model, trained.target_fingerprint, trained.layer_ids)
    assert torch.equal(rebuilt.drafter.embed_tokens.weight, trained.drafter.embed_tokens.weight)
    for result, name in ((trained, "in_process"), (rebuilt, "from_checkpoint")):
        export_drafter(result.drafter, data_dir / name, target_model=result.target_model,
                       target_fingerprint=result.target_fingerprint, dtype=torch.float32)
    for file in ("config.json", "model.safetensors"):
        assert (data_dir / "in_process" / file).read_bytes() == (data_dir / "from_checkpoint" / file).read_bytes()


def test_an_unfinished_checkpoint_is_not_exported(make_run, tiny_model_dir, data_dir):
    paths = make_run(train={**TRAIN, "save_every": 3})  # keeps steps 6 and 8
    spec = RunSpec.load(data_dir, paths.run)
    train_drafter(spec, data=data_dir, model_dir=tiny_model_dir, device="cpu")
    shutil.rmtree(paths.checkpoint(8))
    with pytest.raises(CheckpointFormatError, match="stopped at step 6 of 8"):
        trained_from_checkpoint(spec, data=data_dir, model_dir=tiny_model_dir)


def test_checkpoints_of_another_number_of_processes_are_refused_naming_the_setting(make_run, tiny_model_dir, data_dir):
    paths = make_run(train=TRAIN)
    train_drafter(RunSpec.load(data_dir, paths.run), data=data_dir, model_dir=tiny_model_dir, device="cpu")
    drafter = trained_from_checkpoint(RunSpec.load(data_dir, paths.run), data=data_dir, model_dir=tiny_model_dir).drafter
    optimizer = torch.optim.AdamW(drafter.trainable_parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(CheckpointFormatError, match="written by 1 training processes, this run has 2.*DRAFTLINE_TRAIN_PROCS=1"):
        resume(paths, 8, 2, drafter, optimizer, scheduler)
