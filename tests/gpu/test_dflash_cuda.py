"""The DFlash drafter's CUDA paths: training under bf16 autocast with the batch on the GPU (the masked SDPA of
the block attention), its export in bf16, and block evaluation in bf16 that decodes the target's own greedy
output and drafts what the CPU drafts."""

from __future__ import annotations

import json

import pytest
import torch

from modeling.dflash import DFlashDrafter
from modeling.dflash_export import export_dflash, load_dflash
from evaluation.evaluate import EvalPrompt, evaluate_prompts, load_target
from services.trainer.train import train_drafter
from shared.runspec import EvalConfig, RunSpec
from tests.support.tiny_runs import DFLASH_TRAIN, demo_messages, write_run

pytestmark = [pytest.mark.gpu, pytest.mark.dflash]

MAX_NEW = 24


@pytest.fixture(scope="module")
def cuda_dflash(tmp_path_factory, tiny_target, tiny_samples, eval_messages):
    data = tmp_path_factory.mktemp("dflash-cuda") / "data"
    data.mkdir()
    paths = write_run(data, "dflash", tiny_target, tiny_samples, eval_messages,
                      train={**DFLASH_TRAIN, "epochs": 40, "lr": 1e-2, "save_every": 1000})
    result = train_drafter(RunSpec.load(data, "dflash"), data=data, model_dir=tiny_target.model_dir, device="cuda")
    records = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    export = export_dflash(result.drafter, data / "export", target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    return result, records, export


def test_dflash_trains_on_cuda_under_autocast(cuda_dflash):
    result, records, _ = cuda_dflash
    assert isinstance(result.drafter, DFlashDrafter) and next(result.drafter.parameters()).device.type == "cuda"
    mean = lambda rows, key: sum(key(r) for r in rows) / len(rows)  # noqa: E731
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN from a fully masked attention row
    assert mean(records[-10:], lambda r: r["loss"]) < mean(records[:5], lambda r: r["loss"]) - 1.0
    assert mean(records[-10:], lambda r: r["acc"][0]) > mean(records[:5], lambda r: r["acc"][0]) + 0.15


def test_block_evaluation_on_cuda_in_bf16_decodes_greedy_and_drafts_what_the_cpu_drafts(cuda_dflash, tiny_target,
                                                                                          eval_messages):
    _, _, export = cuda_dflash
    prompts = [EvalPrompt(100 + i, m) for i, m in enumerate([*eval_messages, *demo_messages()[:3]])]
    cfg = EvalConfig(max_new_tokens=MAX_NEW, draft_steps=3, curve_max_steps=3, baselines=False)
    reports = {}
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        target, tokenizer = load_target(tiny_target.model_dir, torch.device(device), dtype)
        embed = target.get_input_embeddings().weight.detach().float().cpu()
        drafter = load_dflash(export, tiny_target.model_dir, embed=embed).to(device).eval()
        reports[device] = evaluate_prompts(target, tokenizer, drafter, prompts, cfg)
    cuda, cpu = reports["cuda"], reports["cpu"]
    assert cuda["greedy_check"]["checked"] == cuda["greedy_check"]["matched"] > 0
    assert cuda["methods"]["drafter"]["curve"]["3"] > 1.5  # trained blocks are accepted on the GPU too
    # bf16 against float32 may flip a near tie; the acceptance stays within a tenth of the CPU's.
    assert abs(cuda["methods"]["drafter"]["curve"]["3"] - cpu["methods"]["drafter"]["curve"]["3"]) < 0.1
