"""``/runs``: submit a run (after preflight), list runs, one run's status, its failures.

Submission runs ``preflight.run_preflight`` first and answers **412** with the failed checks, each naming
its fix, unless the body says ``"force": true``. A base checkpoint given as a Hub repo id is fetched onto
the volume by preflight, and the run records that directory, which is where the trainer reads it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.controller.preflight import run_preflight
from services.controller.routes.deps import ConnDep, SettingsDep
from services.controller.served import served_model
from services.controller.status import list_status, run_status
from services.controller.submit import default_run_name, submit_run
from shared.disk import BYTES_PER_TOKEN_ESTIMATE
from shared.errors import DatasetError, InferenceUnavailable, RunExists, RunNotFound
from shared.jobs import SAMPLE_STAGES
from shared.layout import check_run_name
from shared.runspec import EvalConfig, ExtractionConfig, GenerationConfig, RunSpec, TrainConfig
from shared.runstate import RunState
from shared.settings import ControllerSettings

router = APIRouter(prefix="/runs", tags=["runs"])


class SubmitRequest(BaseModel):
    """The body of ``POST /runs``; mirrors ``submit_run``'s arguments."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(
        ..., min_length=1, description="JSONL/Parquet path (absolute, or relative to the volume) or a Hub repo id."
    )
    name: str | None = None
    limit: int | None = Field(None, ge=1)
    model: str | None = Field(None, description="Served model name; by default the one the inference server lists.")
    split: str = Field("train", min_length=1)
    generation: GenerationConfig | None = None
    extraction: ExtractionConfig | None = None
    train: TrainConfig | None = None
    evaluate: EvalConfig | None = None
    force: bool = Field(False, description="Start the run even when preflight checks fail.")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str | None) -> str | None:
        return None if name is None else check_run_name(name)


def resolve_dataset(dataset: str, data: Path) -> str:
    """Relative paths name files on the volume when such a file exists; anything else passes through."""
    path = Path(dataset)
    if not path.is_absolute() and (Path(data) / path).exists():
        return str(Path(data) / path)
    return dataset


def _known_run(run: str) -> str:
    try:
        return check_run_name(run)
    except ValueError:
        raise HTTPException(status_code=404, detail=f"no run {run!r}") from None


def draft_spec(settings: ControllerSettings, body: SubmitRequest, model: str) -> RunSpec:
    """The run's settings before its dataset is read (row counts stay 0): what preflight checks."""
    dataset = resolve_dataset(body.dataset, settings.data)
    return RunSpec(
        name=check_run_name(body.name or default_run_name(dataset)), dataset=dataset, split=body.split,
        limit=body.limit, model=model, generation=body.generation or GenerationConfig(),
        extraction=body.extraction or ExtractionConfig(), train=body.train or TrainConfig(),
        evaluate=body.evaluate or EvalConfig(),
    )


@router.post("", status_code=201)
def create_run(body: SubmitRequest, settings: SettingsDep, conn: ConnDep) -> dict:
    try:
        draft = draft_spec(settings, body, body.model or served_model(settings.inference_url))
    except InferenceUnavailable as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from None
    except ValueError as exc:  # an invalid default run name derived from the dataset, say
        raise HTTPException(status_code=422, detail=str(exc)) from None
    report = run_preflight(settings, spec=draft, force=body.force)
    if not report.allowed:
        names = ", ".join(c.name for c in report.errors)
        raise HTTPException(status_code=412, detail={
            "message": f"preflight failed ({names}); fix these or submit with \"force\": true",
            "failed": [asdict(c) for c in report.errors], "checks": [asdict(c) for c in report.checks],
        })
    train = draft.train
    if report.base_checkpoint is not None:
        train = train.model_copy(update={"base_checkpoint": report.base_checkpoint})
    try:
        spec = submit_run(
            settings.data, conn, dataset=draft.dataset, name=draft.name, limit=draft.limit, model=draft.model,
            split=draft.split, generation=draft.generation, extraction=draft.extraction, train=train,
            evaluate=draft.evaluate,
        )
    except RunExists as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    except DatasetError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None
    except InferenceUnavailable as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from None
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None
    if report.bytes_per_token:
        # Until its first sample lands, the supervisor projects the run's disk needs from this.
        RunState(conn, settings.data, spec.name).set_meta(**{BYTES_PER_TOKEN_ESTIMATE: report.bytes_per_token})
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
