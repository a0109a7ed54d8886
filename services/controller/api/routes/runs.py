"""``/runs``: submit a run (after preflight), list runs, one run's status, its failures, and a retrain of a
finished capture (``POST /runs/<run>/retrain``).

Submission goes through ``start.start_run`` (preflight, then submission) and answers **412** with the
failed checks, each naming its fix, unless the body says ``"force": true``; a local dataset outside the
dataset roots is **403**. Who may call these routes is ``services.controller.api.auth``'s business.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.controller.api.routes.deps import ConnDep, SettingsDep
from services.controller.loop.reconcile import reconcile_run
from services.controller.runs.preflight import FAILED_CHECKS
from services.controller.runs.retrain import RetrainRefused, retrain_run
from services.controller.runs.served import served_model
from services.controller.runs.start import DatasetOutsideRoots, PreflightFailed, RunRequest, start_run
from services.controller.runs.status import list_status, run_status
from shared.errors import DatasetError, InferenceUnavailable, RunExists, RunNotFound
from shared.lifecycle import SAMPLE_STAGES
from shared.layout import check_run_name
from shared.runspec import (
    DEFAULT_SPLIT,
    RETRAIN_SECTIONS,
    EvalConfig,
    ExtractionConfig,
    GenerationConfig,
    OnlineConfig,
    TrainConfig,
)
from runtime.runstate import RunState

router = APIRouter(prefix="/runs", tags=["runs"])


class SubmitRequest(BaseModel):
    """The body of ``POST /runs``; mirrors ``submit_run``'s arguments."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(
        ..., min_length=1, max_length=4096,
        description="JSONL/Parquet path (absolute, or relative to the volume) inside a dataset root, or a Hub repo id.",
    )
    name: str | None = None
    limit: int | None = Field(None, ge=1)
    model: str | None = Field(None, description="Served model name; by default the one the inference server lists.")
    split: str = Field(DEFAULT_SPLIT, min_length=1)
    generation: GenerationConfig | None = None
    extraction: ExtractionConfig | None = None
    train: TrainConfig | None = None
    evaluate: EvalConfig | None = None
    online: OnlineConfig | None = None
    force: bool = Field(False, description="Start the run even when preflight checks fail.")

    def run_request(self, model: str) -> RunRequest:
        return RunRequest(dataset=self.dataset, model=model, name=self.name, limit=self.limit, split=self.split,
                          generation=self.generation, extraction=self.extraction, train=self.train,
                          evaluate=self.evaluate, online=self.online)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str | None) -> str | None:
        return None if name is None else check_run_name(name)


class RetrainRequest(BaseModel):
    """The body of ``POST /runs/<run>/retrain``: the new run's name and the train and evaluate settings it changes
    (partial sections, laid over the source's; ``retrain.derived_spec`` validates them as a run's)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    train: dict[str, Any] | None = None
    evaluate: dict[str, Any] | None = None
    online: dict[str, Any] | None = None  # an online retrain extracts the states again as it trains

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        return check_run_name(name)


def _known_run(run: str) -> str:
    try:
        return check_run_name(run)
    except ValueError:
        raise HTTPException(status_code=404, detail=f"no run {run!r}") from None


@router.post("", status_code=201)
def create_run(body: SubmitRequest, settings: SettingsDep, conn: ConnDep) -> dict:
    try:
        spec, _ = start_run(settings, conn, body.run_request(body.model or served_model(settings.inference_url)),
                            force=body.force)
    except PreflightFailed as exc:
        raise HTTPException(status_code=412, detail={
            "message": str(exc) + " (\"force\": true in the body)",
            FAILED_CHECKS: [asdict(c) for c in exc.report.errors], "checks": [asdict(c) for c in exc.report.checks],
        }) from None
    except RunExists as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    except DatasetOutsideRoots as exc:
        raise HTTPException(status_code=403, detail=str(exc)) from None
    except DatasetError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None
    except InferenceUnavailable as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from None
    except ValueError as exc:  # an invalid default run name derived from the dataset, say
        raise HTTPException(status_code=422, detail=str(exc)) from None
    return spec.model_dump(mode="json")


@router.post("/{run}/retrain", status_code=201)
def retrain(run: str, body: RetrainRequest, settings: SettingsDep, conn: ConnDep) -> dict:
    """A new run training on ``run``'s finished capture (services/controller/runs/retrain.py), registered at once."""
    sections = {part: value for part, value in zip(RETRAIN_SECTIONS, (body.train, body.evaluate, body.online)) if value}
    try:
        spec = retrain_run(settings.data, conn, _known_run(run), body.name, sections, register=reconcile_run).spec
    except RunNotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    except (RunExists, RetrainRefused) as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    except ValueError as exc:  # a setting out of range or misspelt, named
        raise HTTPException(status_code=422, detail=str(exc)) from None
    return spec.model_dump(mode="json")


@router.get("")
def get_runs(settings: SettingsDep, conn: ConnDep) -> list[dict]:
    return list_status(settings.data, conn)


@router.get("/{run}")
def get_run(run: str, settings: SettingsDep, conn: ConnDep) -> dict:
    try:
        return run_status(settings.data, conn, _known_run(run))
    except RunNotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None


@router.get("/{run}/failures")
def get_failures(
    run: str,
    settings: SettingsDep,
    conn: ConnDep,
    stage: Annotated[str | None, Query(pattern="^(" + "|".join(SAMPLE_STAGES) + ")$")] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> dict:
    state = RunState(conn, settings.data, _known_run(run))
    if not state.meta() and not state.paths.spec.is_file():
        raise HTTPException(status_code=404, detail=f"no run {run!r}")
    failures = state.failures(stage)
    return {"run": run, "total": len(failures), "offset": offset,
            "failures": [asdict(f) for f in failures[offset: offset + limit]]}
