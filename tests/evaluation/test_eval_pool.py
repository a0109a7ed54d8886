"""Evaluation in several processes reports what one process reports, and a failing process is named."""

from __future__ import annotations

import pytest
import torch

from evaluation.eval_pool import (
    EvaluatedModels,
    EvaluationProcessFailed,
    evaluate_sets_in_processes,
    shard,
)
from evaluation.evalsets import EvalPrompt, EvalSet
from evaluation.evaluate import evaluate_sets, load_target
from modeling.export import export_drafter, load_drafter
from services.trainer.train import train_drafter
from shared.runspec import EvalConfig, RunSpec
from tests.support.tiny_runs import demo_messages, write_run

CFG = EvalConfig(max_new_tokens=12, draft_steps=2, curve_max_steps=3)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tiny_target, tiny_samples, eval_messages):
    data = tmp_path_factory.mktemp("pool") / "data"
    data.mkdir()
    write_run(data, "pool", tiny_target, tiny_samples, eval_messages, train={"epochs": 20, "lr": 1e-2, "save_every": 1000})
    result = train_drafter(RunSpec.load(data, "pool"), data=data, model_dir=tiny_target.model_dir, device="cpu")
    out = data / "export"
    export_drafter(result.drafter, out, target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    return out


def sets_of(eval_messages) -> list[EvalSet]:
    # The last holdout prompt is a second turn: each process answers its first turn itself.
    second_turn = EvalPrompt(13, eval_messages[3], (tuple(eval_messages[0]),))
    return [EvalSet("holdout", [*(EvalPrompt(10 + i, m) for i, m in enumerate(eval_messages[:3])), second_turn], []),
            EvalSet("humaneval", [EvalPrompt(i, m) for i, m in enumerate(demo_messages()[:2])], [7])]


def test_every_prompt_lands_in_exactly_one_share():
    prompts = [EvalPrompt(i, []) for i in range(7)]
    shares = [shard(prompts, i, 3) for i in range(3)]
    assert sorted(p.sample_id for s in shares for p in s) == list(range(7)) and [len(s) for s in shares] == [3, 2, 2]


def test_three_processes_report_what_one_process_reports(export_dir, tiny_target, eval_messages):
    target, tokenizer = load_target(tiny_target.model_dir, torch.device("cpu"))
    drafter = load_drafter(export_dir, tiny_target.model_dir,
                           embed=target.get_input_embeddings().weight.detach().float()).eval()
    one = evaluate_sets(target, tokenizer, drafter, sets_of(eval_messages), CFG)
    seen = []
    models = EvaluatedModels(tiny_target.model_dir, export_dir, "cpu", "float32")
    many = evaluate_sets_in_processes(models=models, sets=sets_of(eval_messages), cfg=CFG, procs=3,
                                      layer_ids=list(drafter.config.layer_ids), progress=lambda d, t: seen.append((d, t)))
    assert sorted(seen) == [(d, 6) for d in range(1, 7)]
    for name in ("holdout", "humaneval"):
        a, b = one["sets"][name], many["sets"][name]
        assert b["processes"] == 3 and a["processes"] == 1
        assert b["methods"] == a["methods"] and b["greedy_check"] == a["greedy_check"]
        assert b["prompts"] == a["prompts"] and b["excluded"] == a["excluded"]
    assert many["acceptance_length"] == one["acceptance_length"] > 1.0 and many["headline_set"] == "holdout"


def test_a_process_that_fails_fails_the_evaluation_naming_it(tmp_path, tiny_target, eval_messages):
    models = EvaluatedModels(tiny_target.model_dir, tmp_path / "no-export", "cpu", "float32")
    with pytest.raises(EvaluationProcessFailed, match=r"evaluation process \d of 2 failed: .*Error"):
        evaluate_sets_in_processes(models=models, sets=sets_of(eval_messages), cfg=CFG, procs=2, layer_ids=[0, 1, 2])
