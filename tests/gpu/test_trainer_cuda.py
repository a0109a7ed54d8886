"""The trainer's CUDA paths for real: batches moved to the GPU, autocast to bf16, CUDA RNG state in the
checkpoints, and the evaluation in bf16 against an independent recomputation of its acceptance."""

from __future__ import annotations

import json
import math

import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer import train as train_module
from evaluation.evaluate import EvalPrompt, evaluate_prompts, load_target
from modeling.export import export_drafter, load_drafter
from services.trainer.train import TrainProgress, train_drafter
from shared.runspec import EvalConfig, RunSpec
from tests.support.tiny_runs import demo_messages, write_run
from tests.support.acceptance import assert_report_matches, expected_report

pytestmark = pytest.mark.gpu

MAX_NEW = 24


class Crash(Exception):
    """Stands in for a killed worker: raised from the progress callback after a given step."""


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


@pytest.fixture()
def batches_seen(monkeypatch) -> list[dict]:
    """What each real ``train_step`` received and computed: where the batch lives, in which dtype, and the
    dtype the drafter's first linear layer put out (bf16 where autocast is on)."""
    seen: list[dict] = []
    real_step = train_module.train_step

    def spying_step(s, batch, seeds):
        record = {"tensors": {(t.device.type, t.dtype) for t in (batch.aux_hidden, batch.last_hidden)},
                  "ids": batch.input_ids.device.type, "mask": batch.loss_mask.device.type}
        def note_dtype(_module, _inputs, out):  # returns None: a forward hook's return value replaces the output
            record.setdefault("fc_out", out.dtype)

        hook = s.drafter.fc.register_forward_hook(note_dtype)
        try:
            result = real_step(s, batch, seeds)
        finally:
            hook.remove()
        record["params"] = {(p.device.type, p.dtype) for p in s.drafter.trainable_parameters()}
        seen.append(record)
        return result

    monkeypatch.setattr(train_module, "train_step", spying_step)
    return seen


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_on_cuda_moves_batches_to_the_gpu_autocasts_to_bf16_and_learns(
    tmp_path, tiny_target, tiny_samples, eval_messages, batches_seen, precision
):
    data = tmp_path / "data"
    data.mkdir()
    paths = write_run(data, "cuda", tiny_target, tiny_samples, eval_messages,
                      train={"epochs": 30, "save_every": 1000, "precision": precision})
    result = train_drafter(RunSpec.load(data, "cuda"), data=data, model_dir=tiny_target.model_dir, device="cuda")
    records = log_records(paths)
    assert [r["step"] for r in records] == list(range(1, 121)) and result.steps == 120 == len(batches_seen)
    for record in batches_seen:
        assert record["tensors"] == {("cuda", torch.float32)} and record["ids"] == record["mask"] == "cuda"
        assert record["fc_out"] == torch.bfloat16  # autocast ran the forward in bf16
        # fp32: the weights the optimizer updates; bf16: the step's copies of the float32 masters
        assert record["params"] == {("cuda", torch.float32 if precision == "fp32" else torch.bfloat16)}
    assert {p.dtype for p in result.drafter.trainable_parameters()} == {torch.float32}  # the trained (master) weights
    assert all(math.isfinite(r["loss"]) and all(math.isfinite(x) for x in r["loss_k"]) for r in records)
    first, last = records[:5], records[-10:]
    mean = lambda rows, key: sum(key(r) for r in rows) / len(rows)
    assert mean(last, lambda r: r["loss"]) < mean(first, lambda r: r["loss"]) - 1.0
    assert mean(last, lambda r: r["acc"][0]) > mean(first, lambda r: r["acc"][0]) + 0.15
    # The checkpoint keeps the GPU's random state beside the CPU's.
    from safetensors.torch import load_file

    rng = load_file(ckpt.latest_checkpoint(paths.checkpoints_dir) / ckpt.RNG_FILE)
    assert {"torch_cpu", "torch_cuda_0"} <= rng.keys()


def test_a_cuda_run_killed_mid_epoch_resumes_on_the_gpu_to_the_end(tmp_path, tiny_target, tiny_samples, eval_messages):
    data = tmp_path / "data"
    data.mkdir()
    paths = write_run(data, "resume", tiny_target, tiny_samples, eval_messages, train={"epochs": 3, "save_every": 2})

    def crash_at_5(p: TrainProgress) -> None:
        if p.step == 5:
            raise Crash(5)

    spec = RunSpec.load(data, "resume")
    with pytest.raises(Crash):
        train_drafter(spec, data=data, model_dir=tiny_target.model_dir, device="cuda", progress=crash_at_5)
    assert ckpt.latest_checkpoint(paths.checkpoints_dir).name.endswith("4")  # saved at 4; 5 was lost
    result = train_drafter(spec, data=data, model_dir=tiny_target.model_dir, device="cuda")
    assert result.steps == 12
    steps = [r["step"] for r in log_records(paths)]
    assert steps[-8:] == list(range(5, 13))  # the resumed run redid step 5 from the checkpoint at 4
    assert next(result.drafter.parameters()).device.type == "cuda"


@pytest.fixture(scope="module")
def cuda_export(tmp_path_factory, tiny_target, tiny_samples, eval_messages):
    """A drafter trained on the GPU and exported in bf16 straight from it, as the train job does."""
    data = tmp_path_factory.mktemp("eval") / "data"
    data.mkdir()
    write_run(data, "trained", tiny_target, tiny_samples, eval_messages, train={"epochs": 40, "lr": 1e-2, "save_every": 1000})
    result = train_drafter(RunSpec.load(data, "trained"), data=data, model_dir=tiny_target.model_dir, device="cuda")
    out = data / "export"
    export_drafter(result.drafter, out, target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    return out


def test_evaluation_on_cuda_in_bf16_reports_the_recomputed_acceptance(cuda_export, tiny_target, eval_messages):
    device = torch.device("cuda")
    # What the evaluate job does (services/trainer/jobs.py _evaluate_export), less the run state in Redis.
    target, tokenizer = load_target(tiny_target.model_dir, device, torch.bfloat16)  # the serving dtype
    assert target.dtype == torch.bfloat16 and target.device.type == "cuda"
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    drafter = load_drafter(cuda_export, tiny_target.model_dir, embed=embed).to(device).eval()
    prompts = [EvalPrompt(100 + i, m) for i, m in enumerate([*eval_messages, *demo_messages()[:3]])]
    report = evaluate_prompts(target, tokenizer, drafter, prompts, EvalConfig(max_new_tokens=MAX_NEW, draft_steps=2))
    assert all(row["tokens"] == sum(row["accepted"]) + 1 for row in report["prompts"])
    # The reference on the same device and dtype: greedy generate, cache-free proposals, the rule replayed.
    expected = expected_report(target, tokenizer, drafter, [p.messages for p in prompts], draft_steps=2, max_new_tokens=MAX_NEW)
    assert_report_matches(report, expected)
    assert expected[1] > 1.0  # drafts were accepted: the number pinned is not the one any drafter gets


def test_the_flex_chain_attention_trains_like_the_dense_one_on_cuda():
    """The compiled block-sparse attention that CUDA training uses against the dense reference, in bf16
    under autocast as training runs: the unroll's outputs and every parameter's gradient, over a padded
    batch whose lengths cross the 128-token blocks, with grouped heads."""
    from modeling.eagle3 import DrafterConfig, Eagle3Drafter
    from services.trainer.objective import TTTObjective

    config = DrafterConfig(hidden_size=256, target_hidden_size=192, intermediate_size=512, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=32, vocab_size=500, draft_vocab_size=300, layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).cuda()
    with torch.no_grad():
        drafter.embed_tokens.weight.normal_()
    ids = torch.randint(0, config.vocab_size, (2, 333), device="cuda")
    aux = torch.randn(2, 333, 3 * config.target_hidden_size, device="cuda")
    outputs, grads = {}, {}
    for flex in (False, True):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            unrolled = TTTObjective(drafter, 7, flex=flex).unroll(ids, aux)
            loss = sum(drafter.logits(h).float().logsumexp(-1).mean() for h in unrolled)
        loss.backward()
        outputs[flex] = torch.stack([h.float() for h in unrolled]).detach()
        grads[flex] = {n: p.grad.float().clone() for n, p in drafter.named_parameters() if p.requires_grad}
    torch.testing.assert_close(outputs[True], outputs[False], atol=3e-2, rtol=3e-2)
    for name, dense in grads[False].items():
        error = (grads[True][name] - dense).norm() / dense.norm()
        assert error < 2e-2, f"{name}: relative gradient difference {error:.3g}"


def test_a_cuda_run_trains_the_same_curve_with_either_attention(tmp_path, tiny_target, tiny_samples, eval_messages):
    """Whole runs on the GPU, flex against dense, same data and seed: the loss curves agree within bf16's
    step-to-step noise (the runs are otherwise identical)."""
    curves = {}
    for attention in ("dense", "flex"):
        data = tmp_path / attention
        data.mkdir()
        paths = write_run(data, "run", tiny_target, tiny_samples, eval_messages,
                          train={"epochs": 3, "save_every": 1000, "attention": attention})
        train_drafter(RunSpec.load(data, "run"), data=data, model_dir=tiny_target.model_dir, device="cuda")
        curves[attention] = [r["loss"] for r in log_records(paths)]
    dense, flex = curves["dense"], curves["flex"]
    assert len(dense) == len(flex) > 5
    assert all(abs(a - b) <= 0.02 * abs(a) + 0.02 for a, b in zip(dense, flex)), list(zip(dense, flex))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_elementwise_functions_equal_their_eager_math_with_gradients(dtype):
    """fused.py's functions as CUDA training runs them (compiled) against the same math run eagerly."""
    from modeling import fused
    from modeling.losses import soft_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(2, 77, 64, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.rand(64, device="cuda", requires_grad=True)
    cos, sin = torch.rand(1, 1, 77, 16, device="cuda"), torch.rand(1, 1, 77, 16, device="cuda")
    rope_in = torch.randn(2, 4, 77, 16, device="cuda", dtype=dtype, requires_grad=True)
    gate, up = (torch.randn(2, 77, 96, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    cases = {
        "rms_norm": (lambda f: f(x, weight, 1e-6, torch.float32), fused.rms_norm, [x, weight]),
        "rms_norm to bf16": (lambda f: f(x, weight, 1e-6, torch.bfloat16), fused.rms_norm, [x, weight]),
        "apply_rope": (lambda f: f(rope_in, cos, sin), fused.apply_rope, [rope_in]),
        "silu_mul": (lambda f: f(gate, up), fused.silu_mul, [gate, up]),
    }
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, (call, compiled, inputs) in cases.items():
        eager = compiled.__wrapped__
        got, want = call(compiled), call(eager)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")
        grads = [torch.autograd.grad(out.float().square().sum(), inputs) for out in (got, want)]
        for g, w in zip(*grads):
            torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name} gradient: {m}")
    logits = (3 * torch.randn(2, 77, 500, device="cuda")).to(dtype).requires_grad_(True)
    probs = torch.randn(2, 77, 500, device="cuda").softmax(-1)
    mask = torch.rand(2, 77, device="cuda") > 0.3
    loss = soft_cross_entropy(logits, probs, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    reference = (-(probs * logits.float().log_softmax(-1)).sum(-1) * mask).sum()
    (ref_grad,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(loss, reference, **tol)
    torch.testing.assert_close(grad, ref_grad, **tol)


@pytest.mark.parametrize("method", ["eagle3", pytest.param("dflash", marks=pytest.mark.dflash)])
def test_held_out_validation_on_cuda_measures_at_every_checkpoint_what_the_cpu_measures(
    method, tmp_path, tiny_target, tiny_samples, eval_messages
):
    import copy

    from services.trainer.data import list_hidden_files
    from services.trainer.validation import Validation, validation_split
    from tests.support.tiny_runs import DFLASH_TRAIN

    data = tmp_path / "data"
    data.mkdir()
    train = {"epochs": 12, "lr": 1e-2, "save_every": 20, "validation_files": 4, **(DFLASH_TRAIN if method == "dflash" else {})}
    paths = write_run(data, "val", tiny_target, tiny_samples, eval_messages, train=train)
    spec = RunSpec.load(data, "val")
    result = train_drafter(spec, data=data, model_dir=tiny_target.model_dir, device="cuda")
    lines = [json.loads(line) for line in paths.validation_log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [*range(20, result.steps, 20), result.steps]
    assert all("curve" in line and "error" not in line for line in lines), lines
    # The last checkpoint's weights are the result's: the same held-out files measured on the CPU in float32.
    _, held_out = validation_split(list_hidden_files(paths), 4)
    on_cpu = Validation(held_out, 1 << 20, spec.evaluate.chain_lengths, torch.device("cpu")).measure(
        copy.deepcopy(result.drafter).cpu().float())
    assert on_cpu["tokens"] == lines[-1]["tokens"] and on_cpu["turns"] == lines[-1]["turns"]
    for k, value in on_cpu["curve"].items():
        # TF32 and CUDA's reduction order may turn a drafter argmax within rounding of a tie: a pass or two.
        assert abs(lines[-1]["curve"][k] - value) <= 0.05 * value, (k, lines[-1]["curve"], on_cpu["curve"])
    assert on_cpu["curve"]["3"] > 1.1  # the drafter learned something: the comparison is not of two 1.0s
