"""Capture once, train many: a new run that trains again on a finished capture, with other training settings.

Generation and extraction are the days of a run; a recipe is minutes to hours. ``retrain_run`` lays a new run
on the volume whose prompts, held-out prompts, replies and hidden-state files are the source run's own files
(hard links: no byte is copied, and either run can be deleted without the other losing a file), whose failure
records are copies of the source's (each run's record of the same capture), and whose ``run.json`` is the
source's with the ``train`` and ``evaluate`` sections changed. The directory is built beside ``runs/`` and
published by one rename, so no reader sees half of it. Then it is an ordinary run on the volume: the
controller rebuilds its state from the files (``reconcile_run``: every sample already settled), enqueues its
train job, and the trainer trains, exports and evaluates it on the same held-out prompts as the source, with
status, Prometheus and the dashboards as for any run.

What the capture fixed cannot change here: generation and extraction settings, the dataset and its split, and
``evaluate.holdout`` (the held-out rows were split from the training rows when the capture was submitted).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import redis

from runtime.disk import volume_usage
from runtime.spool import DEFAULT_BUDGET_SHARE
from runtime.runstate import RunState, known_runs, read_finished
from services.controller.runs.submit import submission_lock
from shared.atomic import atomic_write_json, fsync_dir
from shared.errors import DraftlineError, RunExists
from shared.layout import RunPaths, check_run_name, runs_root
from shared.lifecycle import SAMPLE_PHASES, RunPhase
from shared.lifecycle import Stage
from shared.runspec import RETRAIN_SECTIONS, RunSpec

log = logging.getLogger(__name__)

FIXED_EVALUATE = ("holdout",)  # evaluate fields the capture fixed (the held-out rows were split at submission)


class RetrainRefused(DraftlineError):
    """A retrain that cannot be made as asked: its source's capture is unfinished, or it changes what the
    capture fixed."""


def linked(paths: RunPaths, online: bool = False) -> list[Path]:
    """The capture's files, shared as links: prompts, held-out prompts, replies, hidden states (and manifests); an
    online retrain extracts its states again as it trains, so it links none."""
    return [paths.prompts, paths.eval_prompts, paths.generated_dir, *(() if online else (paths.hidden_dir,))]


def copied(paths: RunPaths) -> list[Path]:
    """The capture's failure records: each run's own copy."""
    return [paths.failures_dir]


class Retrained(NamedTuple):
    spec: RunSpec
    registered: Any  # what ``register`` returned (the controller's reconcile report), None without one


def retrain_run(data: Path, conn: redis.Redis, source: str, name: str, sections: dict[str, dict[str, Any]],
                register: Callable[[Path, redis.Redis, str], Any] | None = None) -> Retrained:
    """Lay run ``name`` on the volume: ``source``'s capture with ``sections`` (train, evaluate) over its settings,
    then ``register(data, conn, name)`` (the controller's reconcile) while the name's submission lock is held."""
    data = Path(data)
    spec = derived_spec(RunSpec.load(data, source), check_run_name(name), sections, data)
    # Under the lock the supervisor leaves the new directory to this caller: otherwise its pass could find the
    # run on the volume and not in Redis and reconcile it at the same moment, and this caller's reconcile would
    # be refused as busy.
    with submission_lock(conn, name):
        _lay(data, conn, source, spec)
        log.info("run %s: laid on the volume from %s's capture (train %s)", name, source, sections.get(Stage.TRAIN, {}))
        registered = register(data, conn, name) if register is not None else None
    return Retrained(spec, registered)


def _lay(data: Path, conn: redis.Redis, source: str, spec: RunSpec) -> None:
    name = spec.name
    source_paths, paths = RunPaths(data, source), RunPaths(data, name)
    if paths.root.exists() or name in known_runs(conn):
        raise RunExists(f"run {name!r} already exists")
    check_capture_finished(RunState(conn, data, source), source_paths)
    building = data / f".retrain-{name}.tmp"  # beside runs/, on the same volume: links and the rename stay there
    shutil.rmtree(building, ignore_errors=True)  # an earlier attempt's debris
    try:
        for part in linked(source_paths, spec.online.enabled):
            link_tree(part, building / part.relative_to(source_paths.root))
        for part in copied(source_paths):
            if part.exists():
                shutil.copytree(part, building / part.relative_to(source_paths.root))
                fsync_files(building / part.relative_to(source_paths.root))
        # Durable before it is published: a crash after the rename must not leave a run whose volume lacks a
        # sample's file or failure record, which the controller would take as work still to do.
        fsync_dirs(building)
        atomic_write_json(building / paths.spec.name, spec.model_dump(mode="json"))
        runs_root(data).mkdir(parents=True, exist_ok=True)
        os.rename(building, paths.root)  # refused by the OS if a run of that name appeared meanwhile
    except BaseException as exc:
        shutil.rmtree(building, ignore_errors=True)
        # Only the rename's refusal means another run took the name; an interrupt or a full disk is itself.
        if isinstance(exc, OSError) and paths.root.exists():
            raise RunExists(f"run {name!r} already exists") from None
        raise
    fsync_dir(runs_root(data))


def derived_spec(source: RunSpec, name: str, sections: dict[str, dict[str, Any]], data: Path) -> RunSpec:
    """The source's settings with ``sections`` over its train, evaluate and online ones, validated as a run's are;
    an online retrain without a budget gets a quarter of the volume's free space."""
    other = sorted(set(sections) - set(RETRAIN_SECTIONS))
    if other:
        raise RetrainRefused(f"a retrain reuses {source.name}'s capture, so section(s) {', '.join(other)} cannot "
                             f"change; it may set {', '.join(RETRAIN_SECTIONS)}")
    fixed = sorted(f"evaluate.{k}" for k in FIXED_EVALUATE
                   if k in sections.get(Stage.EVALUATE, {}) and sections[Stage.EVALUATE][k] != getattr(source.evaluate, k))
    if fixed:
        raise RetrainRefused(f"{', '.join(fixed)} cannot change: {source.name}'s held-out rows were split from its "
                             "training rows when the capture was submitted")
    raw = source.model_dump(mode="json")
    raw.update(name=name, created_at=time.time(),
               **{part: {**raw[part], **sections.get(part, {})} for part in RETRAIN_SECTIONS})
    spec = RunSpec.model_validate(raw)  # a misspelt or out-of-range setting fails here, named, before any file
    if spec.online.enabled and spec.online.budget_bytes is None:
        free = volume_usage(data)[0]
        spec = spec.model_copy(update={"online": spec.online.model_copy(
            update={"budget_bytes": max(1, int(free * DEFAULT_BUDGET_SHARE))})})
    return spec


def check_capture_finished(state: RunState, paths: RunPaths) -> None:
    """Refuse a source whose generation or extraction is still under way: its files are not the whole capture."""
    if read_finished(paths) is not None:
        return
    phase = RunPhase.of(state.meta().get("state"))
    if phase in SAMPLE_PHASES:
        raise RetrainRefused(f"run {state.run} is still {phase}: retrain it once every sample is settled "
                             "(draftline status shows the run training or later)")


def link_tree(source: Path, target: Path) -> None:
    """``target`` as a tree of hard links to ``source``'s files (nothing when ``source`` is absent)."""
    if source.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target)
        return
    if not source.is_dir():
        return
    for root, _, files in os.walk(source):
        here = target / Path(root).relative_to(source)
        here.mkdir(parents=True, exist_ok=True)
        for file in files:
            os.link(Path(root) / file, here / file)


def fsync_files(root: Path) -> None:
    """Every file under ``root``: copies, whose bytes are new (a hard link's are already durable)."""
    for here, _, files in os.walk(root):
        for file in files:
            with open(Path(here) / file, "rb") as handle:
                os.fsync(handle.fileno())


def fsync_dirs(root: Path) -> None:
    """Every directory under ``root``: the entries that name the links and the copies."""
    for here, _, _ in os.walk(root):
        fsync_dir(Path(here))
