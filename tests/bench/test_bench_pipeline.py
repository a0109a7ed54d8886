"""The whole-pipeline benchmark runs end to end on a CPU-sized configuration (its speed is measured on the
GPU machine, never here) and writes the figures bench/RESULTS.md is written from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.slow


def test_the_benchmark_runs_the_pipeline_and_writes_its_figures(tmp_path, tiny_model_dir, redis_url):
    out = tmp_path / "figures.json"
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "bench/bench_pipeline.py", "--data", str(tmp_path / "data"), "--prompts", "10", "--small",
         "--device", "cpu", "--model-dir", str(tiny_model_dir), "--inference-replicas", "2", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["training_prompts"] == 10 and figures["samples"]["generated"] == 10
    # --inference-replicas overrides the small run's one server; the worker counts stay the small run's.
    assert figures["replicas"] == {"inference": 2, "generator": 1, "extractor": 1}
    assert set(figures["stage_seconds"]) == {"generate", "extract", "train", "evaluate"}
    assert sum(figures["stage_seconds"].values()) <= figures["wall_seconds"] + 1
    assert figures["training_curve"][-1]["loss"] > 0 and figures["hidden_bytes"] > 0
    # Two files held out of training (train.validation_files), measured at the end of training.
    assert figures["validation_curve"][-1]["files"] == 2 and set(figures["validation_curve"][-1]["curve"]) == {"1", "2"}
    for name in ("holdout", "humaneval"):
        one = figures["evaluation"][name]
        assert set(one["drafter"]["curve"]) == set(one["lookup"]["curve"]) == {"1", "2"}
        assert one["no_drafter"]["acceptance_length"] == 1.0
        assert one["greedy_check"]["checked"] == one["prompts"] * 5
        assert one["drafter_method"] == "eagle3"
        assert set(one["drafter"]["one_pass_curve"]) == set(one["lookup"]["one_pass_curve"]) == {"1", "2"}
        assert one["one_pass_apart"] is not None
        assert set(one["over_lookup"]) == {"1", "2"}  # every k decoded here, so every k has its margin's interval

    # The sweep retrains the run's files three ways (a DFlash drafter from the same files among them) and
    # evaluates each export on the same sets, drafter only.
    sweep = tmp_path / "sweep.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_train_sweep.py", "--data", str(tmp_path / "data"), "--run",
         "bench-smollm2-10", "--model-dir", str(tiny_model_dir), "--device", "cpu", "--json", str(sweep),
         "--variant", 'fp8={"storage": "fp8"}', "--variant", 'lr={"lr": 3e-3, "epochs": 2}',
         "--variant", 'dflash={"method": "dflash", "dflash": {"block_size": 3, "layers": 1, "anchors": 8}}'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    swept = json.loads(sweep.read_text())
    assert list(swept["variants"]) == ["fp8", "lr", "dflash"]
    fp8, lr, dflash = (swept["variants"][name] for name in ("fp8", "lr", "dflash"))
    assert fp8["files"] == lr["files"] == figures["samples"]["extracted"] - 2  # two held out for validation
    assert lr["train"]["lr"] == 3e-3 and lr["train"]["epochs"] == 2 and fp8["train"]["lr"] == figures["run"]["train"]["lr"]
    assert lr["hidden_bytes"] == swept["source_hidden_bytes"]  # the same files, linked
    assert fp8["hidden_bytes"] < 0.5 * swept["source_hidden_bytes"]  # float32 states as one byte each
    assert lr["steps"] > fp8["steps"]  # two epochs against the small run's one
    assert dflash["files"] == lr["files"] and dflash["train"]["method"] == "dflash"
    # Exported as the run's trainer exports (the target's dtype), so a variant differs in its training alone.
    assert {v["export_dtype"] for v in (fp8, lr, dflash)} == {swept["source_export_dtype"]}
    for variant in (fp8, lr, dflash):
        assert variant["loss"] > 0
        for name in ("holdout", "humaneval"):
            one = variant["sets"][name]
            assert set(one["curve"]) == {"1", "2"} and one["prompts"] == figures["evaluation"][name]["prompts"]
            assert one["greedy_matched"] == one["greedy_checked"] == one["prompts"] * 2 and one["mismatches"] == 0
            per_forward = one["accepted_per_drafter_forward"]  # a chain's k forwards a pass against a block's one
            steps = 1 if variant is dflash else 2
            assert per_forward["2"] == pytest.approx((one["curve"]["2"] - 1) / steps)

    # Measured by one pass instead: the source run's export first, beside its decoded curves, then the variant.
    quick = tmp_path / "sweep-one-pass.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_train_sweep.py", "--data", str(tmp_path / "data"), "--run",
         "bench-smollm2-10", "--model-dir", str(tiny_model_dir), "--device", "cpu", "--json", str(quick),
         "--one-pass", "--variant", 'lr={"lr": 3e-3, "epochs": 2, "files": 5}',
         "--variant", 'decoded={"lr": 3e-3, "measure": "decode"}'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    swept = json.loads(quick.read_text())
    # "files": 5 trains on five of the run's files (the variant holds its own validation files out of them).
    assert swept["variants"]["lr"]["files"] == 5 - figures["run"]["train"]["validation_files"]
    assert swept["variants"]["decoded"]["files"] == figures["samples"]["extracted"] - 2
    for name in ("holdout", "humaneval"):
        source = swept["one_pass"]["source"][name]
        assert source["decoded_curve"] == figures["evaluation"][name]["drafter"]["curve"]
        assert source["curve"] == figures["evaluation"][name]["drafter"]["one_pass_curve"]  # the same walk, the same replies
        # Prompt lookup beside it, by one pass and as the run decoded it: the margin stands without the decodes.
        assert source["lookup_curve"] == figures["evaluation"][name]["lookup"]["one_pass_curve"]
        assert source["decoded_lookup_curve"] == figures["evaluation"][name]["lookup"]["curve"]
        assert source["prompts"] == swept["one_pass"]["prompts"][name] == figures["evaluation"][name]["prompts"]
        one = swept["variants"]["lr"]["sets"][name]
        assert one["measured_by"] == "one_pass" and set(one["curve"]) == {"1", "2"}
        assert all(value >= 1.0 for value in one["curve"].values())
        # Each margin on the same replies, with its interval over the set's prompts: the source over lookup, the
        # variant over the source.
        for k in ("1", "2"):
            over_lookup, over_source = source["over_lookup"][k], one["over_source"][k]
            assert over_lookup["difference"] == pytest.approx(source["curve"][k] - source["lookup_curve"][k])
            assert over_source["difference"] == pytest.approx(one["curve"][k] - source["curve"][k])
            for margin in (over_lookup, over_source):  # a handful of prompts: no interval (margin.MIN_PROMPTS)
                assert margin["low"] is margin["high"] is None
                assert margin["prompts"] <= source["prompts"]  # replies with a point to draft at
        decoded = swept["variants"]["decoded"]["sets"][name]  # "measure": "decode" overrides --one-pass
        assert decoded["measured_by"] == "decode" and decoded["greedy_checked"] == decoded["prompts"] * 2
        assert set(decoded["one_pass_curve"]) == {"1", "2"}


def test_the_sharegpt_benchmark_regenerates_two_turns_and_reports_the_second_apart(tmp_path, tiny_model_dir,
                                                                                   redis_url):
    """ShareGPT's first eight conversations from the installed package (six trained on, two held out, the
    second of them of four turns), each regenerated for at most its first two user turns; the drafter a DFlash
    one (``--train``), so its training, export and block evaluation run through the real services too."""
    out = tmp_path / "figures.json"
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "bench/bench_pipeline.py", "--data", str(tmp_path / "data"), "--dataset", "sharegpt",
         "--prompts", "6", "--small", "--device", "cpu", "--model-dir", str(tiny_model_dir), "--json", str(out),
         "--train", "method=dflash,dflash.block_size=3,dflash.layers=1,dflash.anchors=8", "--eval", "decode=headline"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["dataset"] == "sharegpt" and figures["run"]["generation"]["max_turns"] == 2
    # --eval decode=headline: k = draft_steps (2 in the small run) decoded and checked, k = 1 by one pass.
    assert figures["run"]["evaluate"]["decode"] == "headline"
    for one in figures["evaluation"].values():
        for method in ("drafter", "lookup"):
            assert one[method]["measured_by"] == {"1": "one_pass", "2": "decode"}
            assert one[method]["curve"]["1"] == one[method]["one_pass_curve"]["1"]
        assert one["greedy_check"]["checked"] == 3 * one["prompts"] and one["one_pass_apart"] is not None
    assert figures["run"]["train"]["method"] == "dflash" and figures["run"]["train"]["dflash"]["block_size"] == 3
    assert all(one["drafter_method"] == "dflash" for one in figures["evaluation"].values())
    samples = figures["samples"]
    # Rows 0, 3, 4 and 5 have two turns or more, rows 1 and 2 one: ten requests for six conversations, each
    # counted once whether its sample ended done or failed (a failed turn counts too).
    assert samples["generated"] + samples["failed"] + samples["dropped"] == 6
    assert samples["generate_requests"] > samples["generated"]
    assert set(figures["evaluation"]) == {"holdout", "holdout_turn2", "humaneval"}
    assert figures["evaluation"]["holdout"]["prompts"] == 2 and figures["evaluation"]["holdout_turn2"]["prompts"] == 1
    turn2 = figures["evaluation"]["holdout_turn2"]
    assert set(turn2["drafter"]["curve"]) == {"1", "2"} and turn2["greedy_check"]["mismatches"] == []


def test_generation_settings_lay_over_the_recipe_and_a_misspelt_one_is_refused_by_name():
    """Issue 47's data levers as a run's options: every turn (max_turns null) and a sampled reply beside the
    greedy one, laid over the ShareGPT recipe, checked before any GPU time."""
    import argparse

    from bench.bench_pipeline import SHAREGPT_RUN, overridden, setting_overrides

    args = argparse.Namespace(generation=setting_overrides("max_turns=null,replies=2,reply_temperature=0.8"),
                              train=setting_overrides("loss=lk_lambda,aux_norm=true"), eval={})
    run = overridden(SHAREGPT_RUN, args)
    assert run["generation"]["max_turns"] is None and run["generation"]["replies"] == 2
    assert run["generation"]["turns"] == SHAREGPT_RUN["generation"]["turns"]  # the rest of the section stays
    assert run["train"]["loss"] == "lk_lambda" and run["train"]["aux_norm"] is True
    assert SHAREGPT_RUN["generation"]["max_turns"] == 2  # the recipe itself untouched
    with pytest.raises(ValueError, match=r"(?s)--generation: .*max_turnz"):
        overridden(SHAREGPT_RUN, argparse.Namespace(generation={"max_turnz": 3}, train={}, eval={}))
