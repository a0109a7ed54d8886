"""RQ job functions of the trainer: ``train`` (train, export, enqueue evaluation) and ``evaluate``.

Each takes one JSON payload (shared.jobs.TrainJob / EvaluateJob), reports progress and state in the run's
Redis metadata, writes results to the volume atomically, and re-raises failures after naming them in the
metadata so RQ records the job as failed.

``train`` trains in its own process, or with DRAFTLINE_TRAIN_PROCS above 1 in that many torchrun processes
(launch.py) while it holds the run's lock; it then exports from their last checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import shlex
import time
from typing import Any

import httpx
import torch

from shared.atomic import atomic_write_json
from shared.drafter_format import layer_ids_of, read_config
from shared.errors import DraftlineError, error_class
from shared.jobs import EvaluateJob, TrainJob
from shared.layout import RunPaths
from shared import metrics
from shared.lifecycle import Stage, StageState
from runtime.queues import connect
from runtime.disk import StageHold, release_stages
from runtime.remote_code import load_from_target
from runtime.sample_queue import enqueue_evaluate
from runtime.shutdown import JobYielded
from runtime.space import write_with_space
from shared.runspec import RunSpec
from runtime.runstate import RunState
from shared.settings import TrainerSettings, load_settings
from services.trainer.data import count_loss_tokens, list_hidden_files
from evaluation.eval_pool import EvaluatedModels, evaluate_sets_in_processes
from evaluation.evalsets import EvalSet, load_sets
from evaluation.engine_acceptance import EngineLaunch, measure_export, verify_agreement
from evaluation.evaluate import (
    LOOKUP,
    evaluate_sets,
    load_evaluated,
    prompt_ids_of,
    verify_greedy_equality,
)
from modeling.export_method import export_dtype, export_trained
from services.trainer.launch import run_torchrun, train_across_nodes, train_procs
from services.trainer.lock import TrainingInProgress, exclusive_training
from services.trainer.progress import progress_reporter
from services.trainer.validation import validation_split
from modeling.target_head import read_target_config
from services.trainer.drafter_init import check_base_checkpoint, expected_layer_ids
from services.trainer.session import TrainResult, pick_device, trained_from_checkpoint
from services.trainer.train import train_drafter
from evaluation.vllm_launch import parse_command

log = logging.getLogger(__name__)

ACCEPTANCE_CURVE_FIELD = "evaluate_accept"  # run meta prefix the exporter reads (META_ACCEPTANCE_CURVE_PREFIX)


@functools.cache
def get_settings() -> TrainerSettings:
    return load_settings(TrainerSettings)


# Below this many learned tokens a drafter predicts little past the commonest words: published EAGLE-3
# drafters learn from tens of millions, and on SmolLM2-135M one trained from 7,195 reached 1.2 on
# held-out prose and 1.0 on HumanEval, where prompt lookup reached 2.6 (bench/RESULTS.md). The run
# still exports one, and says so.
MIN_USEFUL_LOSS_TOKENS = 100_000


def too_small_warning(loss_tokens: int) -> str:
    """Why this run's drafter will be weak, or an empty string when it learned from enough tokens."""
    if loss_tokens >= MIN_USEFUL_LOSS_TOKENS:
        return ""
    return (f"trained on only {loss_tokens:,} reply tokens (under {MIN_USEFUL_LOSS_TOKENS:,}): too little data for a "
            "useful drafter; expect low acceptance (eval.json sets it beside prompt lookup). Add prompts for a drafter to serve")


def _run_context(run: str) -> tuple[TrainerSettings, Any, RunState, RunPaths]:
    settings = get_settings()
    conn = connect(settings.redis_url)
    return settings, conn, RunState(conn, settings.data, run), RunPaths(settings.data, run)


def train(payload: dict) -> dict:
    job = TrainJob.model_validate(payload)
    settings, conn, state, paths = _run_context(job.run)
    try:
        spec = RunSpec.load(settings.data, job.run)
        with exclusive_training(paths):
            result = _train_and_export(spec, settings, state, paths)
        learned = learned_tokens(spec, paths)
    except (TrainingInProgress, JobYielded):
        raise  # the run's state belongs to the trainer holding the lock; a stopped one resumes from its checkpoint
    except Exception as exc:  # every way out of here but success leaves the run's train stage named failed
        state.set_stage(Stage.TRAIN, StageState.FAILED, train_error=f"{error_class(exc)}: {exc}")
        raise
    warning = too_small_warning(learned)
    if warning:
        log.warning("run %s: %s", job.run, warning)
    state.set_stage(Stage.TRAIN, StageState.DONE, export_path=str(paths.export_dir), train_finished_at=time.time(),
                    train_draft_vocab=result.draft_vocab, train_loss_tokens=learned, train_warning=warning)
    enqueue_evaluate(conn, job.run, replace_failed=True)
    log.info("run %s: trained %d steps (draft vocabulary from the %s), exported to %s, evaluation queued", job.run,
             result.steps, result.draft_vocab, paths.export_dir)
    return {"run": job.run, "steps": result.steps, "export_path": str(paths.export_dir), "draft_vocab": result.draft_vocab}


def learned_tokens(spec: RunSpec, paths: RunPaths) -> int:
    """Loss tokens one pass trains on: counted in the files, or, online (the files are gone), summed from the
    training log's first epoch."""
    if not spec.online.enabled:
        trained, _ = validation_split(list_hidden_files(paths), spec.train.validation_files)
        return count_loss_tokens(trained, spec.train_max_length)
    total = 0
    for line in paths.train_log.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("epoch") == 0:
            total += int(record.get("tokens", 0))
    return total


def _train_and_export(spec: RunSpec, settings: TrainerSettings, state: RunState, paths: RunPaths) -> TrainResult:
    procs = train_procs(settings)
    target_config = read_target_config(settings.model_dir)
    # A base checkpoint that does not fit fails here by name, before any process trains (in torchrun's
    # ranks it would surface as a failed rank).
    check_base_checkpoint(spec.train, data=settings.data, model_dir=settings.model_dir, target_config=target_config,
                          layer_ids=expected_layer_ids(spec, target_config))
    release_stages(state.conn, state.run)  # a killed trainer's wait for space is not this one's
    hold = StageHold(state.conn, state.run, Stage.TRAIN)
    state.set_stage(Stage.TRAIN, StageState.RUNNING, train_started_at=time.time(), train_procs=procs,
                    train_nodes=settings.train_nodes)
    if settings.train_nodes > 1 or procs > 1:  # rank 0 reports progress and writes the checkpoints
        if settings.train_nodes > 1:
            train_across_nodes(spec.name, procs, settings, state.conn)
        else:
            run_torchrun(spec.name, procs, settings)
        result = trained_from_checkpoint(spec, data=settings.data, model_dir=settings.model_dir)
    else:
        result = train_drafter(spec, data=settings.data, model_dir=settings.model_dir, device=settings.device,
                               progress=progress_reporter(state), space_hold=hold, state=state,
                               trust_remote_code=settings.trust_remote_code)
    write_with_space(lambda: export_trained(result.drafter, paths.export_dir, target_model=result.target_model,
                                            target_fingerprint=result.target_fingerprint,
                                            dtype=export_dtype(settings.model_dir)),
                     "the export", settings.data, hold=hold)
    return result


def evaluate(payload: dict) -> dict:
    job = EvaluateJob.model_validate(payload)
    settings, _, state, paths = _run_context(job.run)
    release_stages(state.conn, state.run, (Stage.EVALUATE,))
    state.set_stage(Stage.EVALUATE, StageState.RUNNING)
    try:
        spec = RunSpec.load(settings.data, job.run)
        sets = load_sets(spec.evaluate, eval_prompts=paths.eval_prompts, train_prompts=paths.prompts,
                         turns=spec.generation.turns)
        if not sets:
            state.set_stage(Stage.EVALUATE, StageState.SKIPPED)
            log.info("run %s: no evaluation set (no rows held out), evaluation skipped", job.run)
            return {"run": job.run, "acceptance_length": None, "eval_report": None}
        report = _evaluate_export(settings, paths, spec, state, sets)
        engine_error = _measure_in_engine(settings, paths, sets, report) if settings.eval_vllm_command else None
        write_with_space(lambda: atomic_write_json(paths.eval_report, report), "the evaluation report", settings.data,
                         hold=StageHold(state.conn, state.run, Stage.EVALUATE))
        state.set_meta(acceptance_length=report["acceptance_length"], **curve_meta(report), **engine_meta(report),
                       **lookup_meta(report))
        # Raised after the report is on the volume: the numbers that failed stay readable.
        verify_greedy_equality(report)
        if engine_error is not None:
            raise engine_error
        if "engine" in report:
            verify_agreement(report["engine"])
    except Exception as exc:
        state.set_stage(Stage.EVALUATE, StageState.FAILED, evaluate_error=f"{error_class(exc)}: {exc}")
        raise
    state.set_stage(Stage.EVALUATE, StageState.DONE)
    log.info("run %s: acceptance length %.3f over %d prompts of %s", job.run, report["acceptance_length"],
             len(report["prompts"]), report["headline_set"])
    return {"run": job.run, "acceptance_length": report["acceptance_length"], "eval_report": str(paths.eval_report)}


def _measure_in_engine(settings: TrainerSettings, paths: RunPaths, sets: list[EvalSet], report: dict) -> Exception | None:
    """vLLM's own acceptance for the export, beside the evaluator's on the same prompts, as ``report["engine"]``;
    a server that fails is named there, and its error returned to be raised once the report is written."""
    from transformers import AutoTokenizer

    headline = next(one for one in sets if one.name == report["headline_set"])
    try:
        tokenizer = load_from_target(AutoTokenizer.from_pretrained, settings.model_dir,
                                     trust_remote_code=settings.trust_remote_code)
        # A prompt whose earlier turns the target answered is left out: its context is the evaluator's decode;
        # so is one the evaluator left out as too long (never decoded, nothing to compare).
        measured = {row["sample_id"] for row in report["sets"][headline.name]["prompts"]}
        asked = [p for p in headline.prompts if not p.earlier and p.sample_id in measured][: settings.eval_vllm_prompts]
        prompts = [(p.sample_id, prompt_ids_of(tokenizer, p)) for p in asked]
        launch = EngineLaunch(parse_command(settings.eval_vllm_command or ""), settings.model_dir, paths.engine_log,
                              engine_args=shlex.split(settings.eval_vllm_args),
                              timeout_s=settings.eval_vllm_start_timeout_s)
        report["engine"] = measure_export(launch, paths.export_dir, report, prompts,
                                          tolerance=settings.eval_vllm_tolerance)
    except (DraftlineError, httpx.HTTPError, OSError) as exc:
        log.error("run %s: vLLM could not measure the export: %s: %s (log %s)", report["run"], error_class(exc), exc,
                  paths.engine_log)
        report["engine"] = {"engine": "vllm", "error": f"{error_class(exc)}: {exc}", "log": str(paths.engine_log)}
        return exc
    return None


def engine_meta(report: dict) -> dict[str, float | str]:
    """vLLM's figure for the status (``evaluate_engine_*``, dropped with the other ``evaluate_`` fields)."""
    engine = report.get("engine")
    if not engine:
        return {}
    if "error" in engine:
        return {"evaluate_engine_error": engine["error"]}
    return {"evaluate_engine_acceptance": engine["acceptance_length"] or 0.0,
            "evaluate_engine_prompts": engine["prompts"]}


def lookup_meta(report: dict) -> dict[str, float]:
    """Prompt lookup at the headline's k and the drafter's margin over it, with its interval over the headline
    set's prompts, for the status (``evaluate_lookup_*``, dropped with the other ``evaluate_`` fields)."""
    k = str(report["draft_steps"])
    lookup = report["methods"].get(LOOKUP, {}).get("curve", {}).get(k)
    margin = report.get("over_lookup", {}).get(k)
    if lookup is None or margin is None:
        return {}
    prefix = metrics.META_OVER_LOOKUP
    # Empty, not absent, where too few prompts give no interval: an earlier evaluation's bounds never linger.
    bounds = {f"{prefix}_{bound}": "" if margin[bound] is None else margin[bound] for bound in ("low", "high")}
    return {metrics.META_EVALUATE_K: int(k), metrics.META_LOOKUP_ACCEPTANCE: lookup, prefix: margin["difference"],
            **bounds, f"{prefix}_prompts": margin["prompts"], f"{prefix}_level": margin["level"]}


def curve_meta(report: dict) -> dict[str, float]:
    """Every set's acceptance curve per method as flat run meta fields, ``evaluate_accept.<set>.<method>.<k>``
    (no drafter as k 0), which the exporter publishes; reopening a run drops them with the other
    ``evaluate_`` fields."""
    fields = {}
    for name, one in report["sets"].items():
        for method, entry in one["methods"].items():
            curve = entry["curve"] if "curve" in entry else {"0": entry["acceptance_length"]}
            fields.update({f"{ACCEPTANCE_CURVE_FIELD}.{name}.{method}.{k}": v for k, v in curve.items()})
    return fields


def _evaluate_export(settings: TrainerSettings, paths: RunPaths, spec: RunSpec, state: RunState, sets: list[EvalSet]) -> dict:
    """The exported drafter (as the engines will load it) against the target on every evaluation set, in
    ``eval_procs`` processes (evaluation.eval_pool) or in this one."""
    device = pick_device(settings.device)
    total = sum(len(s.prompts) for s in sets)
    state.set_progress(Stage.EVALUATE, 0, total)
    progress = lambda done, total: state.set_progress(Stage.EVALUATE, done, total)  # noqa: E731
    if settings.eval_procs > 1:
        models = EvaluatedModels(settings.model_dir, paths.export_dir, str(device), settings.eval_dtype,
                                 trust_remote_code=settings.trust_remote_code)
        report = evaluate_sets_in_processes(
            models=models, sets=sets, cfg=spec.evaluate, procs=min(settings.eval_procs, max(total, 1)),
            layer_ids=layer_ids_of(read_config(paths.export_dir), None), progress=progress)
    else:
        target, tokenizer, drafter = load_evaluated(settings.model_dir, paths.export_dir, device,
                                                    getattr(torch, settings.eval_dtype),
                                                    trust_remote_code=settings.trust_remote_code)
        report = evaluate_sets(target, tokenizer, drafter, sets, spec.evaluate, progress=progress)
    return {**report, "run": spec.name, "export_path": str(paths.export_dir), "dtype": settings.eval_dtype}
