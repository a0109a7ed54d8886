"""bf16 weights with float32 masters against float32 weights: the same learning, exact resumes, and the
trained masters (not their bf16 copies) in checkpoints and in the finished drafter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from services.trainer import checkpoint as ckpt
from modeling.eagle3 import RMSNorm
from services.trainer.precision import BF16, FP32, MasterWeights, UnsupportedPrecision, make_weights, precision_kind
from services.trainer.train import TIMING_FIELDS, TrainProgress, train_drafter
from shared.runspec import RunSpec


class Crash(Exception):
    """Stands in for a killed worker: raised from the progress callback at a given step."""


def train(paths, model_dir, **kwargs):
    return train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=model_dir, device="cpu", **kwargs)


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] if key == "loss" else r[key][0] for r in rows) / len(rows)


def test_an_unknown_precision_is_refused_by_name():
    assert precision_kind("bf16") == BF16 and precision_kind("fp32") == FP32
    with pytest.raises(ValueError, match="fp16"):
        precision_kind("fp16")


def test_bf16_weights_over_several_processes_are_refused_naming_the_setting():
    assert precision_kind("fp32", world=2) == FP32
    with pytest.raises(UnsupportedPrecision, match="train.precision to fp32"):
        precision_kind("bf16", world=2)


def test_master_weights_step_in_float32_and_hand_the_step_its_bf16_copy():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4, bias=False)
    start = layer.weight.detach().clone()
    weights = make_weights(layer, BF16)
    assert isinstance(weights, MasterWeights) and layer.weight.dtype == torch.bfloat16
    assert torch.equal(weights.masters[0].data, start)  # the master is the float32 weight itself
    optimizer = torch.optim.SGD(weights.optimizer_params, lr=1e-3)
    weights.zero_grad(optimizer)
    layer(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().sum().backward()
    (master,) = weights.grads_to_optimizer()
    assert master.grad.dtype == torch.float32 and torch.equal(master.grad, layer.weight.grad.float())
    optimizer.step()
    weights.after_update()
    weights.zero_grad(optimizer)
    assert layer.weight.grad is None and master.grad is None
    moved = weights.masters[0].data
    assert not torch.equal(moved, start) and moved.dtype == torch.float32
    assert torch.equal(layer.weight.data, moved.to(torch.bfloat16))  # the step's copy follows its master
    # An update under bf16's resolution is kept in the master, where a bf16 weight would lose it.
    assert not torch.equal(moved.to(torch.bfloat16).float(), moved)
    with weights.full_precision():
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight.data, moved)
    assert layer.weight.dtype == torch.bfloat16
    weights.finish()
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight.data, moved)


def test_the_norm_under_autocast_gives_its_matmuls_the_values_they_would_round_to():
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    plain = norm(x)
    assert plain.dtype == torch.float32  # float32 weight times the bf16 normed value
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = norm(x)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, plain.to(torch.bfloat16))


def test_bf16_weights_learn_as_float32_weights_do(make_run, tiny_model_dir):
    curves = {}
    for precision in (FP32, BF16):
        paths = make_run(precision, train={"epochs": 30, "save_every": 1000, "precision": precision})
        result = train(paths, tiny_model_dir)
        assert result.steps == 120
        assert {p.dtype for p in result.drafter.trainable_parameters()} == {torch.float32}
        curves[precision] = log_records(paths)
    exact, low = curves[FP32], curves[BF16]
    assert low[0]["loss"] != exact[0]["loss"]  # the steps really computed in bf16
    assert abs(low[0]["loss"] - exact[0]["loss"]) < 0.01 * exact[0]["loss"]  # the same weights and data: bf16 rounding
    assert mean(low[-10:], "loss") < mean(low[:5], "loss") - 1.0
    assert abs(mean(low[-10:], "loss") - mean(exact[-10:], "loss")) < 0.05 * mean(exact[-10:], "loss")
    assert abs(mean(low[-10:], "acc") - mean(exact[-10:], "acc")) < 0.05


def test_a_bf16_run_killed_mid_epoch_resumes_from_its_float32_masters_to_the_same_weights(make_run, tiny_model_dir):
    train_cfg = {"epochs": 3, "save_every": 3, "precision": BF16}
    straight = train(make_run("straight", train=train_cfg), tiny_model_dir)
    paths = make_run("killed", train=train_cfg)

    def crash_at_5(p: TrainProgress) -> None:
        if p.step == 5:
            raise Crash(5)

    with pytest.raises(Crash):
        train(paths, tiny_model_dir, progress=crash_at_5)
    saved = load_file(ckpt.latest_checkpoint(paths.checkpoints_dir) / ckpt.MODEL_FILE)
    trained = [t for name, t in saved.items() if name.startswith("midlayer.")]
    assert {t.dtype for t in trained} == {torch.float32}
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t) for t in trained)  # masters, not bf16 copies
    resumed = train(paths, tiny_model_dir)
    assert resumed.steps == straight.steps == 12
    a, b = resumed.drafter.export_state(), straight.drafter.export_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop_time = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert drop_time(log_records(paths)) == drop_time(log_records(type(paths)(paths.data, "straight")))
