"""Data-parallel training: two real torchrun processes over gloo take the steps one process takes."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from modeling.export import export_drafter
from services.trainer.launch import run_torchrun
from services.trainer.batching import BATCHINGS, SHUFFLE, plan_epoch, share
from services.trainer.session import resume, trained_from_checkpoint
from services.trainer.sources import epoch_plan
from services.trainer.train import train_drafter
from shared import eagle3
from shared.errors import CheckpointFormatError
from shared.runspec import RunSpec, TrainConfig
from shared.settings import TrainerSettings, load_settings
from tests.support.tiny_runs import DFLASH_TRAIN, write_run

# 13 samples in global batches of 4: three full batches and a one-sample tail, which leaves rank 1 of two
# with a stand-in sample that must add nothing.
SAMPLES = 13
TRAIN = {"epochs": 2, "ttt_steps": 2, "save_every": 100}

# The DDP comparison takes two optimizer steps, a global batch of four samples of unequal lengths and then
# a one-sample tail (rank 1 a stand-in), and keeps both checkpoints (KEEP_CHECKPOINTS is 2): the Adam state
# of each step gives the (clipped) gradient it took, m_t = b1 m_{t-1} + (1 - b1) g_t.
DDP_SAMPLES = 5
DDP_TRAIN = {"epochs": 1, "ttt_steps": 2, "save_every": 1}
UNIT_ROUNDOFF = 2.0**-24  # float32


def unequal(samples: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Samples cut by 0, 6, 12 and 18 tokens in turn: ranks then hold different loss-token counts."""
    cut = lambda sample, drop: {k: v[: v.shape[0] - drop].contiguous() for k, v in sample.items()}
    return [cut(sample, (i % 4) * 6) for i, sample in enumerate(samples)]


def settings_for(data_dir, model_dir, redis_url) -> TrainerSettings:
    return load_settings(TrainerSettings, data=data_dir, model_dir=model_dir, device="cpu", redis_url=redis_url)


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


@pytest.mark.parametrize("batching", [SHUFFLE, "length"])
def test_rank_shares_cover_each_global_batch_once_and_only_the_tail_has_stand_ins(batching) -> None:
    lengths = [10 + (i * 7) % 23 for i in range(SAMPLES)]
    plan = plan_epoch(lengths, seed=0, epoch=0, batch_size=2, world=2, batching=batching)
    assert len(plan) == 4  # every rank takes every step
    assert sorted(i for batch in plan for i in batch) == list(range(SAMPLES))
    for batch in plan:
        parts = [share(batch, rank, 2) for rank in range(2)]
        assert sorted(i for p in parts if not p.filler for i in p.indices) == sorted(batch)
    fillers = [share(batch, 1, 2).filler for batch in plan]
    assert fillers.count(True) == 1 and len(plan[fillers.index(True)]) == 1  # the one-sample tail only
    assert not any(share(batch, 0, 2).filler for batch in plan)


def regrouping_tolerance(samples: list[dict[str, torch.Tensor]], ttt_steps: int) -> float:
    """Relative bound on regrouping a float32 sum: two orders of a sum of n terms differ by at most
    2 (n - 1) u sum|terms|. Two processes sum a step's gradients and losses in two partial sums plus an
    all-reduce, over batches padded to other widths, where one process sums them in one go; the longest
    such sum runs over every token of the global batch in every TTT step, and sum|terms| is taken as the
    largest value of the result (a loss, a gradient norm, a gradient tensor's largest element). Here n is
    about 360 (four samples of 36 to 60 tokens, two TTT steps), so about 4e-5. Step 2 also starts from
    weights step 1 left a little apart. Measured: at most 6e-7 of a tensor's largest gradient (2e-6 with
    MKL held to SSE4.2 kernels) and 1e-7 in a loss or gradient norm. A mean per rank instead of over the
    global batch moves a step's gradient by 4e-2 of its largest element and its norm by 2e-2; a missing
    factor of the world size halves the norm (and nothing else while grad_clip clips, which takes out
    the scale)."""
    tokens = sum(int(sample[eagle3.INPUT_IDS].numel()) for sample in samples[:4])
    return 2 * tokens * ttt_steps * UNIT_ROUNDOFF


def adam_ratio_bound(step: int, beta1: float, beta2: float) -> float:
    """Bound on |m_hat| / sqrt(v_hat) after ``step`` steps (Cauchy-Schwarz over the two averages' weights)."""
    w = [(1 - beta1) * beta1 ** (step - s) / (1 - beta1**step) for s in range(1, step + 1)]
    c = [(1 - beta2) * beta2 ** (step - s) / (1 - beta2**step) for s in range(1, step + 1)]
    return math.sqrt(sum(wi * wi / ci for wi, ci in zip(w, c, strict=True)))


def adam_drift(delta: torch.Tensor, v_hat: torch.Tensor, step: int, group: dict) -> torch.Tensor:
    """How far apart one Adam step (no weight decay) can move a weight in two runs whose gradients so far
    differ by at most ``delta``: the update is lr m_hat / (sqrt(v_hat) + eps), m_hat and sqrt(v_hat) are
    averages of the gradients with weights summing to 1 (so each moves by at most delta), and
    |m_hat| / sqrt(v_hat) <= R; hence |update - update'| <= lr min(2 R, (1 + R) delta / (sqrt(v_hat) -
    delta + eps)). A weight whose gradient cancels to about eps (1e-8) is ill-conditioned: there the bound
    is the 2 lr R any two Adam steps can differ by: the first step's lr g / (|g| + eps) turns float32
    noise of 5e-10 in such a gradient into lr 5e-10 / (4 eps) = 4e-5 (at lr 3e-3), which is how one weight
    of fc came 3.6e-5 apart against the fixed tolerance of 2e-5 this test had before."""
    ratio = adam_ratio_bound(step, *group["betas"])
    near = (1 + ratio) * delta / ((v_hat.sqrt() - delta).clamp(min=0) + group["eps"])
    return group["initial_lr"] * torch.clamp(near, max=2 * ratio)


def adam_states(paths, step: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """A checkpoint's weights, its Adam state tensors and its parameter group."""
    found = paths.checkpoint(step)
    state = json.loads((found / "state.json").read_text())
    return (load_file(found / "model.safetensors"), load_file(found / "optimizer.safetensors"),
            state["optimizer"]["param_groups"][0])


def step_gradients(paths, steps: int) -> list[dict[str, torch.Tensor]]:
    """The clipped gradient of each step, as Adam took it: (m_t - b1 m_{t-1}) / (1 - b1)."""
    gradients, previous = [], None
    for step in range(1, steps + 1):
        _, slots, group = adam_states(paths, step)
        beta1 = group["betas"][0]
        moments = {k.removesuffix("/exp_avg"): v.double() for k, v in slots.items() if k.endswith("/exp_avg")}
        gradients.append({name: (m - beta1 * (previous[name] if previous else 0)) / (1 - beta1) for name, m in moments.items()})
        previous = moments
    return gradients


@pytest.mark.parametrize("method", ["eagle3", pytest.param("dflash", marks=pytest.mark.dflash)])
def test_two_gloo_processes_train_what_one_process_trains_on_the_same_global_batches(
    method, data_dir, tiny_target, tiny_samples, eval_messages, tiny_model_dir, redis_url,
):
    # DFlash draws its anchors per sample and step, so the two ranks draw the blocks one process draws.
    train = {**DDP_TRAIN, **(DFLASH_TRAIN if method == "dflash" else {})}
    samples = unequal(tiny_samples[:DDP_SAMPLES])
    one = write_run(data_dir, "one", tiny_target, samples, eval_messages, train={**train, "batch_size": 4})
    two = write_run(data_dir, "two", tiny_target, samples, eval_messages, train={**train, "batch_size": 2})
    single = train_drafter(RunSpec.load(data_dir, "one"), data=data_dir, model_dir=tiny_model_dir, device="cpu")

    run_torchrun("two", 2, settings_for(data_dir, tiny_model_dir, redis_url))
    double = trained_from_checkpoint(RunSpec.load(data_dir, "two"), data=data_dir, model_dir=tiny_model_dir)
    # A loss sum runs over every token and TTT step (EAGLE-3), or over every anchor and mask slot (DFlash: at
    # most every token, times block_size - 1 slots).
    terms = DDP_TRAIN["ttt_steps"] if method == "eagle3" else DFLASH_TRAIN["dflash"]["block_size"] - 1
    assert_two_ranks_trained_what_one_did(one, two, single, double, samples, terms)


def test_two_processes_measure_the_held_out_files_on_rank_zero_alone(data_dir, tiny_target, tiny_samples,
                                                                     eval_messages, tiny_model_dir, redis_url):
    """Rank 0 measures while rank 1 waits at the next step's all-reduce: training finishes on both, the held-out
    curve is logged once per checkpoint, and the files held out trained on neither rank."""
    paths = write_run(data_dir, "held", tiny_target, tiny_samples[:8], eval_messages,
                      train={**DDP_TRAIN, "batch_size": 2, "save_every": 2, "validation_files": 2},
                      evaluate={"curve_max_steps": 2, "draft_steps": 2})
    run_torchrun("held", 2, settings_for(data_dir, tiny_model_dir, redis_url))
    result = trained_from_checkpoint(RunSpec.load(data_dir, "held"), data=data_dir, model_dir=tiny_model_dir)
    assert result.num_files == 6 and result.steps == 2  # 6 files trained, 4 a global batch of two ranks
    lines = [json.loads(line) for line in paths.validation_log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [2]
    assert lines[0]["files"] == 2 and set(lines[0]["curve"]) == {"1", "2"}


def checkpoint_world(paths, step: int) -> int:
    return json.loads((paths.checkpoint(step) / "state.json").read_text())["world_size"]


def test_a_run_with_a_global_batch_resumes_on_another_number_of_processes(
    data_dir, tiny_target, tiny_samples, eval_messages, tiny_model_dir, redis_url, caplog,
):
    """Checkpoints of two processes resumed by one, and of one by two: the same steps as one process
    uninterrupted, because with train.global_batch_size the batches do not depend on the process count."""
    samples = unequal(tiny_samples[:DDP_SAMPLES])
    train = {**DDP_TRAIN, "global_batch_size": 4}
    one, down, up = (write_run(data_dir, name, tiny_target, samples, eval_messages, train=train)
                     for name in ("one", "down", "up"))
    settings = settings_for(data_dir, tiny_model_dir, redis_url)
    single = train_drafter(RunSpec.load(data_dir, "one"), data=data_dir, model_dir=tiny_model_dir, device="cpu")

    run_torchrun("down", 2, settings)
    shutil.rmtree(down.checkpoint(2))  # stopped after step 1
    with caplog.at_level(logging.INFO, logger="services.trainer"):
        resumed_on_one = train_drafter(RunSpec.load(data_dir, "down"), data=data_dir, model_dir=tiny_model_dir,
                                       device="cpu")
    assert "resuming from step 1 of 2 on 1 training processes (the checkpoint's: 2)" in caplog.text
    assert (checkpoint_world(down, 1), checkpoint_world(down, 2)) == (2, 1)
    assert_two_ranks_trained_what_one_did(one, down, single, resumed_on_one, samples)

    train_drafter(RunSpec.load(data_dir, "up"), data=data_dir, model_dir=tiny_model_dir, device="cpu")
    shutil.rmtree(up.checkpoint(2))
    run_torchrun("up", 2, settings)
    assert (checkpoint_world(up, 1), checkpoint_world(up, 2)) == (1, 2)
    resumed_on_two = trained_from_checkpoint(RunSpec.load(data_dir, "up"), data=data_dir, model_dir=tiny_model_dir)
    assert_two_ranks_trained_what_one_did(one, up, single, resumed_on_two, samples)


def test_a_global_batch_is_the_same_batches_on_any_number_of_processes() -> None:
    lengths = [5 + (i * 37) % 90 for i in range(50)]
    cfg = TrainConfig(global_batch_size=6)
    for batching in BATCHINGS:
        plans = [epoch_plan(cfg, lengths, 1, world, batching) for world in (1, 2, 3, 4)]
        assert all(plan == plans[0] for plan in plans)
        assert sorted(i for batch in plans[0] for i in batch) == list(range(50))
        assert sorted(len(batch) for batch in plans[0]) == [2] + [6] * 8  # 50 = 8 x 6 and a tail of 2


def assert_two_ranks_trained_what_one_did(one, two, single, double, samples: list[dict[str, torch.Tensor]],
                                         terms: int = DDP_TRAIN["ttt_steps"]) -> None:
    """Run ``two`` (two ranks for at least one step, result ``double``) took the steps run ``one`` (one process,
    ``single``) took on the same global batches: losses, gradients and weights within the bounds regrouping
    the sums allows."""
    steps = 2
    assert double.steps == single.steps == steps
    assert 2 in {checkpoint_world(two, step) for step in range(1, steps + 1)}
    tolerance = regrouping_tolerance(samples, terms)

    first, second = log_records(one), log_records(two)
    assert [r["step"] for r in second] == [r["step"] for r in first] == [1, 2]
    for r1, r2 in zip(first, second, strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=tolerance)  # the global batch's loss, not rank 0's
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=tolerance)  # the global batch's gradient
        assert r2["lr"] == pytest.approx(r1["lr"])

    # Each step's gradient, weight by weight, to within the regrouping bound relative to its tensor's largest.
    deltas = {}
    for g1, g2 in zip(step_gradients(one, steps), step_gradients(two, steps), strict=True):
        for name in g1:
            atol = tolerance * float(g1[name].abs().max())
            torch.testing.assert_close(g2[name], g1[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
            deltas[name] = max(deltas.get(name, 0.0), atol)

    # The weights after each step, to within what Adam makes of gradients that close (plus float32 rounding
    # of the updates); trained_from_checkpoint returns the last step's.
    drift = dict.fromkeys(deltas, 0.0)
    for step in range(1, steps + 1):
        (w1, slots, group), (w2, _, _) = adam_states(one, step), adam_states(two, step)
        for name, delta in deltas.items():
            v_hat = slots[f"{name}/exp_avg_sq"].double() / (1 - group["betas"][1] ** step)
            drift[name] = drift[name] + adam_drift(torch.tensor(delta), v_hat, step, group)
            rounding = 2 * step * UNIT_ROUNDOFF * (w1[name].abs().double() + 4 * group["initial_lr"])
            gap = (w2[name].double() - w1[name].double()).abs()
            worst = float((gap - drift[name] - rounding).max())
            assert worst <= 0, f"step {step} {name}: weights {gap.max():.2e} apart, {worst:.2e} past the bound"
    a, b = single.drafter.checkpoint_state(), double.drafter.checkpoint_state()
    assert a.keys() == b.keys()
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    for name in deltas:
        assert torch.equal(b[name], w2[name]) and torch.equal(a[name], w1[name])


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
    cfg = RunSpec.load(data_dir, paths.run).train
    with pytest.raises(CheckpointFormatError, match="written by 1 training processes with batch_size per process, this "
                                                    "run has 2; set DRAFTLINE_TRAIN_PROCS.*global_batch_size"):
        resume(paths, cfg, 8, 2, drafter, optimizer, scheduler)
    # A global batch resumes on another number only if it is the one the checkpoint trained with.
    with pytest.raises(CheckpointFormatError, match="written by 1 training processes"):
        resume(paths, cfg.model_copy(update={"global_batch_size": 4}), 8, 2, drafter, optimizer, scheduler)
