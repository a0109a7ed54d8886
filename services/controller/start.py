"""Starting a run, as ``POST /runs`` and ``draftline run`` both do: preflight first, then submission.

A run whose preflight fails is refused (``PreflightFailed`` carries the report, each failed check naming
its fix) unless forced. A base checkpoint given as a Hub repo id is fetched onto the volume by preflight,
and the run records that directory, which is where the trainer reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis

from services.controller.preflight import PreflightReport, run_preflight
from services.controller.submit import default_run_name, submit_run
from shared.disk import BYTES_PER_TOKEN_ESTIMATE
from shared.errors import DatasetError, DraftlineError
from shared.layout import check_run_name
from shared.runspec import (
    EvalConfig,
    ExtractionConfig,
    GenerationConfig,
    RunSpec,
    TrainConfig,
)
from shared.runstate import RunState
from shared.settings import ControllerSettings


class PreflightFailed(DraftlineError):
    """Preflight found errors; the run was not started."""

    def __init__(self, report: PreflightReport) -> None:
        names = ", ".join(check.name for check in report.errors)
        super().__init__(f"preflight failed ({names}); fix these or start the run with force")
        self.report = report


@dataclass(frozen=True)
class RunRequest:
    """What a user asks for; everything not given takes the RunSpec defaults."""

    dataset: str
    model: str
    name: str | None = None
    limit: int | None = None
    split: str = "train"
    generation: GenerationConfig | None = None
    extraction: ExtractionConfig | None = None
    train: TrainConfig | None = None
    evaluate: EvalConfig | None = None


def resolve_dataset(dataset: str, data: Path) -> str:
    """Relative paths name files on the volume when such a file exists; anything else passes through."""
    path = Path(dataset)
    try:
        on_volume = not path.is_absolute() and (Path(data) / path).exists()
    except OSError as exc:  # a name the file system refuses (ENAMETOOLONG) names no file anywhere
        shown = dataset[:80] + ("…" if len(dataset) > 80 else "")
        raise DatasetError(f"dataset {shown!r}: not a readable path ({exc.strerror or exc}) and not a Hugging Face "
                           "repo id") from None
    return str(Path(data) / path) if on_volume else dataset


def draft_spec(settings: ControllerSettings, request: RunRequest) -> RunSpec:
    """The run's settings before its dataset is read (row counts stay 0): what preflight checks."""
    dataset = resolve_dataset(request.dataset, settings.data)
    return RunSpec(
        name=check_run_name(request.name or default_run_name(dataset)), dataset=dataset, split=request.split,
        limit=request.limit, model=request.model, generation=request.generation or GenerationConfig(),
        extraction=request.extraction or ExtractionConfig(), train=request.train or TrainConfig(),
        evaluate=request.evaluate or EvalConfig(),
    )


def start_run(settings: ControllerSettings, conn: redis.Redis, request: RunRequest, *,
              force: bool = False) -> tuple[RunSpec, PreflightReport]:
    """Preflight, then submit; raises PreflightFailed, or submission's RunExists / DatasetError."""
    draft = draft_spec(settings, request)
    report = run_preflight(settings, spec=draft, force=force)
    if not report.allowed:
        raise PreflightFailed(report)
    train = draft.train
    if report.base_checkpoint is not None:
        train = train.model_copy(update={"base_checkpoint": report.base_checkpoint})
    spec = submit_run(
        settings.data, conn, dataset=draft.dataset, name=draft.name, limit=draft.limit, model=draft.model,
        split=draft.split, generation=draft.generation, extraction=draft.extraction, train=train,
        evaluate=draft.evaluate,
    )
    if report.bytes_per_token:
        # Until its first sample lands, the supervisor projects the run's disk needs from this.
        RunState(conn, settings.data, spec.name).set_meta(**{BYTES_PER_TOKEN_ESTIMATE: report.bytes_per_token})
    return spec, report
