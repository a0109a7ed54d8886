"""Starting a run, as ``POST /runs`` and ``draftline run`` both do: preflight first, then submission.

A run whose preflight fails is refused (``PreflightFailed`` carries the report, each failed check naming
its fix) unless forced. A base checkpoint given as a Hub repo id is fetched onto the volume by preflight,
and the run records that directory, which is where the trainer reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from services.controller.runs.datasets import PACKAGED, looks_like_repo_id, packaged_dataset, split_files
from services.controller.runs.preflight import PreflightReport, run_preflight
from services.controller.runs.submit import default_run_name, submit_run
from runtime.disk import BYTES_PER_TOKEN_ESTIMATE, reserve_for, volume_usage
from runtime.spool import DEFAULT_BUDGET_SHARE
from shared.errors import DatasetError, DraftlineError
from shared.layout import check_run_name
from shared.lifecycle import Stage
from shared.runspec import (
    DEFAULT_SPLIT,
    EvalConfig,
    ExtractionConfig,
    GenerationConfig,
    OnlineConfig,
    RunSpec,
    TrainConfig,
)
from runtime.runstate import RunState
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
    split: str = DEFAULT_SPLIT
    generation: GenerationConfig | None = None
    extraction: ExtractionConfig | None = None
    train: TrainConfig | None = None
    evaluate: EvalConfig | None = None
    online: OnlineConfig | None = None


class DatasetOutsideRoots(DatasetError):
    """A local dataset lies outside every folder ``DRAFTLINE_DATASET_ROOTS`` names."""


def resolve_dataset(dataset: str, data: Path, roots: Sequence[Path], split: str = DEFAULT_SPLIT) -> str:
    """The dataset a run reads: a local path inside one of ``roots`` (absolute, symlinks and ``..``
    resolved), a Hugging Face repo id, or the file of a packaged dataset named in ``PACKAGED``.

    A relative path names a file on the volume when one exists there; else a repo id (``owner/name``)
    goes to the Hub, unless a local path of that name shadows it (it is checked like any path)."""
    if dataset in PACKAGED:  # a name, not a path: the file an installed package ships, trusted as code is
        return str(packaged_dataset(dataset))
    path = Path(dataset)
    try:
        if path.is_absolute():
            return _inside_roots(dataset, path, roots, split)
        on_volume = Path(data) / path
        if on_volume.exists():
            return _inside_roots(dataset, on_volume, roots, split)
        if path.exists():  # resolve_files would read it, relative to the working directory
            return _inside_roots(dataset, path, roots, split)
        if looks_like_repo_id(dataset):
            return dataset
        return _inside_roots(dataset, on_volume, roots, split)  # missing: submission says so, if inside a root
    except (OSError, ValueError) as exc:  # a name the file system refuses (ENAMETOOLONG, a NUL byte)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise DatasetError(f"dataset {_shown(dataset)!r}: not a readable path ({reason}) and not a Hugging Face "
                           "repo id") from None


def _inside_roots(dataset: str, path: Path, roots: Sequence[Path], split: str) -> str:
    """``path`` resolved, if it and every file it stands for lie inside a root; else DatasetOutsideRoots."""
    resolved = path.resolve()
    _check_inside(dataset, resolved, roots)
    if resolved.is_dir():
        # A folder's split files may be links to anywhere; each must resolve inside a root too.
        for file in split_files(resolved, split):
            _check_inside(dataset, file.resolve(), roots)
    return str(resolved)


def _check_inside(dataset: str, resolved: Path, roots: Sequence[Path]) -> None:
    if not any(resolved == root or root in resolved.parents for root in roots):
        shown = ", ".join(str(root) for root in roots)
        raise DatasetOutsideRoots(
            f"dataset {_shown(dataset)!r} resolves to {_shown(str(resolved))}, outside the dataset roots ({shown}): "
            "put the dataset in one of them, or add its folder to DRAFTLINE_DATASET_ROOTS"
        )


def _shown(text: str) -> str:
    return text[:80] + ("…" if len(text) > 80 else "")


def draft_spec(settings: ControllerSettings, request: RunRequest) -> RunSpec:
    """The run's settings before its dataset is read (row counts stay 0): what preflight checks."""
    dataset = resolve_dataset(request.dataset, settings.data, settings.dataset_root_paths(), request.split)
    return RunSpec(
        name=check_run_name(request.name or default_run_name(dataset)), dataset=dataset, split=request.split,
        limit=request.limit, model=request.model, generation=request.generation or GenerationConfig(),
        extraction=request.extraction or ExtractionConfig(), train=request.train or TrainConfig(),
        evaluate=request.evaluate or EvalConfig(), online=online_with_budget(settings, request.online),
    )


def online_with_budget(settings: ControllerSettings, online: OnlineConfig | None) -> OnlineConfig:
    """The run's online settings with its byte budget fixed: as asked, or a quarter of the volume's free space
    less the reserve (stored in run.json, so a later change of free space does not move it)."""
    online = online or OnlineConfig()
    if not online.enabled or online.budget_bytes is not None:
        return online
    free, total = volume_usage(settings.data)
    room = free - reserve_for(total, settings.disk_reserve_bytes, settings.disk_reserve_fraction)
    return online.model_copy(update={"budget_bytes": max(1, int(room * DEFAULT_BUDGET_SHARE))})


def start_run(settings: ControllerSettings, conn: redis.Redis, request: RunRequest, *,
              force: bool = False) -> tuple[RunSpec, PreflightReport]:
    """Preflight, then submit; raises PreflightFailed, or submission's RunExists / DatasetError."""
    draft = draft_spec(settings, request)
    report = run_preflight(settings, spec=draft, force=force)
    if not report.allowed:
        raise PreflightFailed(report)
    if report.base_checkpoint is not None:
        draft = draft.model_copy(update={Stage.TRAIN: draft.train.model_copy(
            update={"base_checkpoint": report.base_checkpoint})})
    spec = submit_run(settings.data, conn, draft)
    if report.bytes_per_token:
        # Until its first sample lands, the supervisor projects the run's disk needs from this.
        RunState(conn, settings.data, spec.name).set_meta(**{BYTES_PER_TOKEN_ESTIMATE: report.bytes_per_token})
    return spec, report
