"""Evaluation spread over processes: each decodes every N-th prompt of every set with its own target and
drafter, and the parent adds their shares up into the report one process would have written.

Each process decodes its prompts as a batch (``speculative_batch``); on a CPU several processes use
several cores where one decode would leave them idle, and on a GPU one process with a large batch is
usually the fastest. The processes are spawned (never forked: CUDA does not
survive a fork), get only JSON-able arguments, and send back plain dicts; a process that dies or raises
fails the evaluation naming it. What every process loads travels as one ``EvaluatedModels``, turned into
a plain dict for the crossing like the evaluation settings and the prompts.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import DraftlineError
from shared.runspec import EvalConfig
from evaluation.evalsets import EvalPrompt, EvalSet

log = logging.getLogger(__name__)

POLL_S = 1.0


class EvaluationProcessFailed(DraftlineError):
    """An evaluation process raised or died; its error and process index are named."""


def shard(prompts: list[EvalPrompt], index: int, procs: int) -> list[EvalPrompt]:
    """Every ``procs``-th prompt from ``index``: long and short prompts spread evenly over the processes."""
    return prompts[index::procs]


@dataclass(frozen=True)
class EvaluatedModels:
    """The target and the exported drafter a measurement process loads (``evaluate.load_evaluated``): they
    travel together from the job to every process, so they are one argument instead of five."""

    model_dir: Path
    export_dir: Path
    device: str  # a torch device name ("cpu", "cuda:0"): a torch.device object is not JSON
    dtype: str  # a torch dtype's name ("float32", "bfloat16")
    trust_remote_code: bool = False

    def to_json(self) -> dict[str, Any]:
        """Plain values only: a spawned process gets nothing it would have to unpickle as a class."""
        return {"model_dir": str(self.model_dir), "export_dir": str(self.export_dir), "device": self.device,
                "dtype": self.dtype, "trust_remote_code": self.trust_remote_code}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> EvaluatedModels:
        return cls(Path(raw["model_dir"]), Path(raw["export_dir"]), raw["device"], raw["dtype"],
                   raw["trust_remote_code"])


def _worker(index: int, procs: int, models: dict[str, Any], sets: list[dict[str, Any]], cfg: dict[str, Any],
            out: Any) -> None:
    try:
        import torch

        from evaluation.evaluate import SetRun, load_evaluated, measure_prompts

        torch.set_num_threads(1)
        config = EvalConfig.model_validate(cfg)
        loaded = EvaluatedModels.from_json(models)
        target, tokenizer, drafter = load_evaluated(loaded.model_dir, loaded.export_dir, torch.device(loaded.device),
                                                    getattr(torch, loaded.dtype),
                                                    trust_remote_code=loaded.trust_remote_code)
        shares = []
        for one in sets:
            measured, reported = SetRun(one["name"]), [0]
            mine = shard([EvalPrompt(p["sample_id"], p["messages"], tuple(tuple(t) for t in p["earlier"]))
                          for p in one["prompts"]], index, procs)

            def progress(done: int, _: int, reported: list[int] = reported) -> None:
                if done > reported[0]:  # prompts whose every decode has finished since the last report
                    out.put(("prompts", index, done - reported[0]))
                    reported[0] = done

            measure_prompts(target, tokenizer, drafter, mine, config, measured, progress)
            shares.append(measured.to_json())
        out.put(("shares", index, shares))  # the process's measurements: it has finished
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the parent must hear of it
        out.put(("error", index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))


def measure_in_processes(
    *, models: EvaluatedModels, sets: list[EvalSet], cfg: EvalConfig, procs: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Per set, in order, the shares of every process (``SetRun.to_json`` dicts)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    payload = [{"name": s.name, "prompts": [{"sample_id": p.sample_id, "messages": p.messages,
                                             "earlier": [list(t) for t in p.earlier]} for p in s.prompts]}
               for s in sets]
    workers = [ctx.Process(target=_worker, name=f"evaluate-{i}", daemon=True,
                           args=(i, procs, models.to_json(), payload, cfg.model_dump(mode="json"), out))
               for i in range(procs)]
    for worker in workers:
        worker.start()
    total, done, results = sum(len(s.prompts) for s in sets), 0, {}
    try:
        while len(results) < procs:
            try:
                kind, index, body = out.get(timeout=POLL_S)
            except queue.Empty:
                _check_alive(workers, results)
                continue
            if kind == "prompts":
                done += body
                if progress is not None:
                    progress(done, total)
            elif kind == "shares":
                results[index] = body
            else:
                raise EvaluationProcessFailed(f"evaluation process {index} of {procs} failed: {body}")
    finally:
        for worker in workers:  # after a failure the others are stopped; after success they are ending
            worker.join(timeout=30 if len(results) == procs else 0)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=10)
    log.info("evaluation: %d prompts over %d processes", total, procs)
    return [[results[i][n] for i in range(procs)] for n in range(len(sets))]


def _check_alive(workers: list[Any], results: dict[int, Any]) -> None:
    for index, worker in enumerate(workers):
        if index not in results and not worker.is_alive():
            raise EvaluationProcessFailed(f"evaluation process {index} of {len(workers)} exited with "
                                          f"{worker.exitcode} before it reported")


def evaluate_sets_in_processes(
    *, models: EvaluatedModels, sets: list[EvalSet], cfg: EvalConfig, procs: int, layer_ids: list[int],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """What ``evaluate.evaluate_sets`` reports, measured by ``procs`` processes."""
    from evaluation.evaluate import SetRun, combine_sets, set_report
    from shared.drafter_format import read_config, speculative_method

    shares = measure_in_processes(models=models, sets=sets, cfg=cfg, procs=procs, progress=progress)
    reports = {}
    for one, parts in zip(sets, shares):
        measured = SetRun(one.name)
        for part in parts:
            measured.merge(part)
        order = {p.sample_id: i for i, p in enumerate(one.prompts)}
        measured.rows.sort(key=lambda row: order[row["sample_id"]])
        reports[one.name] = {**set_report(measured, cfg, layer_ids, speculative_method(read_config(models.export_dir))),
                             "excluded": one.excluded, "processes": procs}
    return combine_sets(reports)
