"""Acceptance as vLLM serves the export: a drafter trained on the rule target's own replies
(tests/engines/target_rule.py), exported, and served by the real vLLM CPU build with
``--speculative-config {"method": "eagle3", ...}``.

The evaluate job, with ``DRAFTLINE_EVAL_VLLM_COMMAND`` set, reports vLLM's acceptance length from its own
``/metrics`` beside the evaluator's on the same prompts and k; the two must agree, and vLLM's greedy text
must equal the evaluator's decodes and vLLM's own text without a drafter. Exports broken the ways engines
misread them (layer ids one lower, another run's ``d2t``) must fall in both figures alike (the foreign
``d2t`` to nothing accepted), so the evaluator can never pass an export an engine would misread.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.drafter_format import CONFIG_FILE, WEIGHTS_FILE, vllm_layer_ids
from shared.layout import RunPaths
from shared.runspec import RunSpec
from evaluation import vllm_launch
from evaluation.engine_acceptance import EngineLaunch, measure_export, serve_and_decode
from evaluation.evalsets import read_eval_prompts
from evaluation.evaluate import combine_sets, evaluate_prompts, exported_drafter, load_target, prompt_ids_of
from modeling.export import export_drafter
from services.trainer.train import train_drafter
from tests.engines import target_rule
from tests.support.tiny_runs import TinyTarget, demo_messages, fingerprint_of, make_sample, write_run
from tests.support.vllm_server import CPU_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.engine_acceptance]

LAYERS = [1, 2, 3]  # of the rule target's 5; vLLM's ids [2, 3, 4]. One lower, [0, 1, 2], is still a valid choice
K = 3
MAX_NEW_TOKENS = 24
TRAIN_PROMPTS, HELD_OUT = 64, 12
# vLLM and the evaluator count the same passes on the same float32 decodes; they have agreed exactly.
TOLERANCE = 0.02
# A trained drafter proposes most of the rule's words; a misread one hardly any.
GOOD, COLLAPSED = 2.5, 1.5
TRAIN = {"epochs": 30, "lr": 1e-2, "batch_size": 8, "ttt_steps": 3, "draft_vocab_size": 32, "save_every": 100_000}
EVALUATE = {"holdout": HELD_OUT, "max_new_tokens": MAX_NEW_TOKENS, "draft_steps": K, "sets": ["holdout"],
            "curve_max_steps": K}


def trained_run(data: Path, name: str, target: TinyTarget, prompts: list[list[dict]], held_out: list[list[dict]],
                layers: list[int] = LAYERS, train: dict | None = None) -> RunPaths:
    """A run trained on the target's replies to ``prompts`` and exported; ``held_out`` its evaluation set."""
    samples = [make_sample(target, m, layers, reply_tokens=MAX_NEW_TOKENS) for m in prompts]
    paths = write_run(data, name, target, samples, held_out, train=train or TRAIN, evaluate=EVALUATE, layer_ids=layers)
    result = train_drafter(RunSpec.load(data, name), data=data, model_dir=target.model_dir, device="cpu")
    export_drafter(result.drafter, paths.export_dir, target_model=result.target_model,
                   target_fingerprint=result.target_fingerprint, dtype=torch.float32)
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rule_target, tiny64_dir) -> dict[str, RunPaths]:
    """``served``: the drafter under test; ``other``: a run for another target of the same tokenizer (tiny64),
    whose draft vocabulary holds other tokens. (Two runs of the rule target choose the same one: every word
    is frequent in both.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path_factory.mktemp("served") / "data"
    held_out = target_rule.prompts(HELD_OUT, seed=1000)
    tiny64 = TinyTarget(AutoModelForCausalLM.from_pretrained(tiny64_dir).eval(), AutoTokenizer.from_pretrained(tiny64_dir),
                        tiny64_dir, fingerprint_of(tiny64_dir))
    return {"served": trained_run(data, "served", rule_target, target_rule.prompts(TRAIN_PROMPTS, seed=1), held_out),
            "other": trained_run(data, "other", tiny64, demo_messages()[:8], held_out, layers=[0, 1, 2],
                                 train={**TRAIN, "epochs": 1})}


@pytest.fixture(scope="module")
def vllm_command(vllm_cpu_python) -> list[str]:
    return vllm_launch.python_command(vllm_cpu_python)


def evaluate_with_vllm(paths: RunPaths, model_dir: Path, vllm_command: list[str], redis_url: str) -> dict:
    """The run's evaluate job, with vLLM configured as a user configures it; its report."""
    from services.trainer import jobs

    env = {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(paths.data), "DRAFTLINE_MODEL_DIR": str(model_dir),
           "DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_EVAL_VLLM_COMMAND": " ".join(vllm_command),
           "DRAFTLINE_EVAL_VLLM_ARGS": " ".join(CPU_ARGS), "DRAFTLINE_EVAL_VLLM_PROMPTS": str(HELD_OUT),
           "DRAFTLINE_EVAL_VLLM_TOLERANCE": str(TOLERANCE)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        jobs.get_settings.cache_clear()
        try:
            result = jobs.evaluate({"run": paths.run})
        finally:
            jobs.get_settings.cache_clear()
    report = json.loads(paths.eval_report.read_text())
    assert result["acceptance_length"] == report["acceptance_length"]
    return report


@pytest.fixture(scope="module")
def job_report(runs, rule_target, vllm_command, redis_server) -> dict:
    """The evaluate job of ``served``, with vLLM configured."""
    return evaluate_with_vllm(runs["served"], rule_target.model_dir, vllm_command, redis_server.url)


def test_vllm_counts_the_acceptance_the_evaluator_reports(job_report, runs, redis_server):
    engine = job_report["engine"]
    assert engine["prompts"] == HELD_OUT and engine["k"] == K and engine["set"] == "holdout"
    assert engine["acceptance_length"] >= GOOD, engine  # a trained drafter, served: the test can tell
    # The same passes, the same accepted drafts: vLLM's counters equal the evaluator's counts exactly.
    assert (engine["drafts"], engine["accepted"]) == (engine["evaluator_passes"], engine["evaluator_accepted_drafts"]), engine
    assert engine["acceptance_length"] == pytest.approx(engine["evaluator_counted_as_vllm"], abs=1e-12)
    # Replies end at the budget here, and vLLM also counts what the last pass accepted past it: its figure
    # lies above the evaluator's headline (emitted tokens only), by no more than that last pass.
    assert 0 <= engine["acceptance_length"] - engine["evaluator_acceptance_length"] <= K * HELD_OUT / engine["drafts"]
    assert engine["greedy_match"] == {"checked": HELD_OUT, "matched": HELD_OUT, "first_mismatch": None}
    assert engine["agrees"]
    # Every held-out prompt is in both figures, so vLLM's figure is also the evaluator's headline.
    assert abs(engine["evaluator_acceptance_length"] - job_report["acceptance_length"]) < 1e-9
    assert 1 + engine["accepted"] / engine["drafts"] == engine["acceptance_length"]
    assert engine["draft_tokens"] == K * engine["drafts"]
    assert runs["served"].engine_log.is_file()  # the server's log stays beside the report


def test_the_status_shows_vllm_figure_beside_the_evaluator(job_report, redis_server, runs):
    import redis

    from services.controller.runs.status import format_status, run_status

    conn = redis.Redis.from_url(redis_server.url)
    status = run_status(runs["served"].data, conn, "served")
    evaluate = status["stages"]["evaluate"]
    assert evaluate["engine_acceptance_length"] == pytest.approx(job_report["engine"]["acceptance_length"])
    assert f"(vLLM {job_report['engine']['acceptance_length']:.2f} on its first {HELD_OUT} prompts)" in format_status(status)


def test_vllm_text_with_the_drafter_equals_its_text_without_one(job_report, runs, rule_target, vllm_command):
    prompts = held_out_ids(rule_target, runs["served"])
    launch = EngineLaunch(vllm_command, rule_target.model_dir, runs["served"].root / "vllm-plain.log",
                          engine_args=CPU_ARGS)
    plain = serve_and_decode(launch, None, K, [ids for _, ids in prompts], MAX_NEW_TOKENS, job_report["stop_ids"])
    rows = {row["sample_id"]: row for row in job_report["prompts"]}
    assert plain.replies == [rows[sample_id]["reply"] for sample_id, _ in prompts]
    assert all(len(reply) == MAX_NEW_TOKENS for reply in plain.replies)  # the rule target never stops on its own
    assert plain.counters.drafts == 0


def held_out_ids(target: TinyTarget, paths: RunPaths) -> list[tuple[int, list[int]]]:
    return [(p.sample_id, prompt_ids_of(target.tokenizer, p)) for p in read_eval_prompts(paths.eval_prompts)]


def shift_layers_down(export: Path) -> None:
    """Every layer-id field one lower, consistently: the export now names the wrong layers for every reader."""
    config = json.loads((export / CONFIG_FILE).read_text())
    ours = [i - 1 for i in config["draftline"]["layer_ids"]]
    config["draftline"]["layer_ids"] = ours
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ours
    config["eagle_aux_hidden_state_layer_ids"] = vllm_layer_ids(ours)
    (export / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def foreign_vocabulary(export: Path, other: Path) -> None:
    """``d2t`` and ``t2d`` from another run's export, the rest unchanged."""
    tensors = load_file(export / WEIGHTS_FILE)
    theirs = load_file(other / WEIGHTS_FILE)
    assert not torch.equal(tensors["d2t"], theirs["d2t"]), "the two runs chose the same draft vocabulary"
    tensors.update(d2t=theirs["d2t"], t2d=theirs["t2d"])
    save_file(tensors, str(export / WEIGHTS_FILE), metadata={"format": "pt"})


@pytest.mark.parametrize("breakage", ["layers_one_lower", "another_runs_d2t"])
def test_a_misread_export_falls_alike_in_both_figures(breakage, job_report, runs, rule_target, vllm_command, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(runs["served"].export_dir, broken)
    if breakage == "layers_one_lower":
        shift_layers_down(broken)
    else:
        foreign_vocabulary(broken, runs["other"].export_dir)
    target, tokenizer = load_target(rule_target.model_dir, torch.device("cpu"))
    drafter = exported_drafter(target, rule_target.model_dir, broken)
    spec = RunSpec.load(runs["served"].data, "served")
    prompts = read_eval_prompts(runs["served"].eval_prompts)
    report = combine_sets({"holdout": evaluate_prompts(target, tokenizer, drafter, prompts, spec.evaluate)})
    launch = EngineLaunch(vllm_command, rule_target.model_dir, tmp_path / "vllm.log", engine_args=CPU_ARGS)
    engine = measure_export(launch, broken, report, held_out_ids(rule_target, runs["served"]), tolerance=TOLERANCE)
    good = job_report["engine"]["acceptance_length"]
    assert engine["agrees"], engine  # what vLLM reads wrong, the evaluator reads wrong the same way
    assert engine["acceptance_length"] < good and engine["evaluator_counted_as_vllm"] < good, engine
    if breakage == "another_runs_d2t":  # every proposal names another token: nothing is accepted
        assert engine["acceptance_length"] <= COLLAPSED and engine["evaluator_counted_as_vllm"] <= COLLAPSED, engine
    # One layer lower costs little on this target (measured 3.81 against 3.88): every layer's output still
    # holds the word before the newest, which is all its rule needs. What the test holds is that the evaluator
    # sees the shift exactly as vLLM does.
