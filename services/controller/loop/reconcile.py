"""Rebuild a run's Redis state from the volume, which is the truth (``draftline resume``, and the
supervisor by itself when Redis has lost a run).

What counts as finished work on the volume:

- **generate**: a reply file that parses as the reply record of its sample. Replies are published by
  atomic rename, so a file is whole or absent; quick mode therefore trusts the existence of the replies
  of samples whose extraction verified, deep mode parses every one.
- **extract**: a hidden-state file that agrees with its entry in the shard's ``manifest.jsonl``. Quick
  mode compares the file's size and safetensors header with the entry and reads a few kilobytes per
  file: a resume over terabytes of hidden states must not read them all. Deep mode (``--deep``) runs
  the full ``verify_hidden_file``, checksum and finiteness included, and reads every byte.
- **failures**: ``failures/<stage>/*.json``, except records of samples that are done (a crash between
  marking a sample done and removing its old record leaves such a stale record behind).

A hidden-state file that disagrees with its entry is deleted so it is extracted again; a file without
an entry (older than ``grace_s``, so not one an extractor is finishing right now) is verified fully
and adopted into the manifest, or deleted. A reply that does not parse is deleted. Temp files older
than ``grace_s`` in the sample directories are deleted. A dataset row that is neither a prompt nor
held out nor named by a failure record gets a failure record (``MissingPromptRow``), so no id is left
unaccounted for.

Redis then gets: the run registered again if it was lost (``run.json`` has everything), the done and
failure bitmaps and failure records merged so that a worker finishing a sample while the resume runs
is never undone, both feeder cursors reset so the feeder re-scans, and ``resumed_at``.

A run is *finished on the volume* once ``runs/<run>/state.json`` exists: the supervisor writes it
atomically when the run reaches complete, complete_with_failures or failed. Unfinished runs that
Redis does not know are what the supervisor rebuilds by itself.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import redis

from shared.atomic import TEMP_PREFIX, atomic_write_json, read_json
from shared.errors import DraftlineError, HiddenStateFileError, error_class
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths, list_runs
from shared.lifecycle import (
    SAMPLE_STAGES,
    WHOLE_RUN_STAGES,
    Failure,
    FailureKind,
    Outcome,
    RunKeys,
    RunPhase,
    Stage,
    StageState,
    failure_field,
    phase_of_stages,
)
from shared.manifest import MANIFEST_NAME, ManifestEntry, append_entry, check_entry, check_quick, read_manifest
from shared.runspec import RunSpec
from runtime.runstate import (
    FINISHED_META,
    GENERATE_REQUESTS_UNCOUNTED,
    RunState,
    bitmap_ids,
    ids_bitmap,
    known_runs,
    read_finished,
)

log = logging.getLogger(__name__)

GRACE_S = 300.0  # files younger than this may belong to a worker that is still running
VERIFY_THREADS = 8
LOCK_TTL_S = 300.0  # refreshed as the scans progress; a crashed resume blocks its run this long at most
LOCK_REFRESH_EVERY = 2000  # files checked between refreshes
REBUILD_BACKOFF_S = 60.0
# A run the volume cannot rebuild stays so until someone acts on it: looked at again every ten minutes, not
# every pass, so the log names it without repeating itself every minute.
NO_PROMPTS_BACKOFF_S = 600.0
_STEM = re.compile(r"^(\d{8})$")


class MissingPromptRow(DraftlineError):
    """A dataset row is not among the prompts, not held out, and its failure record is lost."""


class RunBusy(DraftlineError):
    """The run is being reconciled, trained or evaluated right now."""


class NoPromptList(DraftlineError):
    """The run's directory holds no ``prompts.jsonl``: its samples cannot be rebuilt from the volume."""


@dataclass
class ReconcileReport:
    """What a resume found on the volume and what it changed."""

    run: str
    deep: bool
    registered: bool = False  # Redis had lost the run and it was registered again
    expected: int = 0
    generated: int = 0  # samples with a verified reply
    extracted: int = 0  # samples with a verified hidden-state file
    adopted: int = 0  # hidden-state files without a manifest entry, verified in full and added to it
    redone: list[dict] = field(default_factory=list)  # {"sample_id", "stage", "reason"}: deleted, to run again
    temp_removed: int = 0
    failures_kept: int = 0
    failures_cleared: int = 0  # stale records of samples that are done
    named: list[int] = field(default_factory=list)  # rows given a MissingPromptRow failure
    state: str = ""
    resumed_at: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.generated:,} replies and {self.extracted:,} hidden-state files verified "
                f"({'deep' if self.deep else 'quick'}), {self.adopted:,} adopted, {len(self.redone):,} redone, "
                f"{self.temp_removed:,} temp files removed, {self.failures_kept:,} failures kept, "
                f"{self.failures_cleared:,} stale failures cleared, {len(self.named):,} lost rows named; "
                f"state {self.state}")


# ---- locks and lost runs ------------------------------------------------------------------------


def reconciling(conn: redis.Redis, run: str) -> bool:
    return bool(conn.exists(RunKeys(run).reconcile_lock))


@contextmanager
def _reconcile_lock(conn: redis.Redis, run: str) -> Iterator[Callable[[], None]]:
    """Hold the run's reconcile lock; yields ``refresh``, to be called while a long scan progresses."""
    key = RunKeys(run).reconcile_lock
    if not conn.set(key, str(time.time()), nx=True, px=int(LOCK_TTL_S * 1000)):
        raise RunBusy(f"run {run!r} is being reconciled right now")
    try:
        yield lambda: conn.pexpire(key, int(LOCK_TTL_S * 1000))
    finally:
        conn.delete(key)


def _checked_in_order(pool: ThreadPoolExecutor, check: Callable, items: list, refresh: Callable[[], None]) -> list:
    """``pool.map(check, items)``, refreshing the lock every ``LOCK_REFRESH_EVERY`` results."""
    results = []
    for index, result in enumerate(pool.map(check, items), start=1):
        results.append(result)
        if index % LOCK_REFRESH_EVERY == 0:
            refresh()
    return results


def back_off(conn: redis.Redis, run: str, seconds: float = REBUILD_BACKOFF_S) -> None:
    """Leave a run that could not be rebuilt alone for a while instead of failing on it every tick."""
    conn.set(RunKeys(run).rebuild_backoff, str(time.time()), ex=int(seconds))


def lost_runs(data: Path, conn: redis.Redis) -> list[str]:
    """Unfinished runs on the volume whose Redis state is gone (not registered, or meta without ``expected``)."""
    known = set(known_runs(conn))
    lost = []
    for run in list_runs(Path(data)):
        if read_finished(RunPaths(Path(data), run)) is not None:
            continue
        keys = RunKeys(run)
        if conn.exists(keys.submit_lock, keys.reconcile_lock, keys.rebuild_backoff):
            continue
        if run in known and conn.hexists(keys.meta, "expected"):
            continue
        lost.append(run)
    return lost


# ---- the run's ids ------------------------------------------------------------------------------


@dataclass
class RunIds:
    rows: int
    prompts: np.ndarray  # bool per id: a prompt in prompts.jsonl
    held_out: np.ndarray  # bool per id: held out for evaluation
    prompts_bytes: int

    @property
    def expected(self) -> np.ndarray:
        return ~self.held_out

    def is_prompt(self, sample_id: int) -> bool:
        """Only a prompt of the run can have finished work (held-out and malformed rows have none)."""
        return 0 <= sample_id < self.rows and bool(self.prompts[sample_id])


def run_ids(paths: RunPaths, spec: RunSpec) -> RunIds:
    rows = max(spec.rows, 1)
    prompts, held_out = np.zeros(rows, dtype=bool), np.zeros(rows, dtype=bool)
    for sample_id in _line_ids(paths.prompts):
        prompts[sample_id] = True
    for sample_id in _line_ids(paths.eval_prompts):
        held_out[sample_id] = True
    return RunIds(spec.rows, prompts[:spec.rows], held_out[:spec.rows], paths.prompts.stat().st_size)


def _line_ids(path: Path) -> Iterator[int]:
    if not path.is_file():
        return
    with open(path, "rb") as handle:
        for line in handle:
            match = re.match(rb'^\{"sample_id": (\d+)[,}]', line)
            yield int(match.group(1)) if match else int(json.loads(line)["sample_id"])


def _sample_files(directory: Path, suffix: str) -> list[tuple[int, Path]]:
    """``(sample_id, path)`` of the sample files in every shard under ``directory``."""
    found = []
    for shard in sorted(directory.glob("rows_*")):
        for path in shard.iterdir():
            match = _STEM.match(path.stem) if path.suffix == suffix else None
            if match:
                found.append((int(match.group(1)), path))
    return sorted(found)


def remove_stale_temps(paths: RunPaths, cutoff: float) -> int:
    """Delete temp files older than ``cutoff`` where samples and failures are written."""
    removed = 0
    for directory in (paths.generated_dir, paths.hidden_dir, paths.failures_dir):
        for path in directory.rglob(TEMP_PREFIX + "*") if directory.is_dir() else ():
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue  # its writer published or removed it meanwhile
    return removed


# ---- extract: hidden-state files against their manifest ---------------------------------------


@dataclass(frozen=True)
class _Checked:
    sample_id: int
    path: Path
    verdict: str  # "ok", "fresh" (being written), "bad", "adopt"
    reason: str = ""
    entry: ManifestEntry | None = None
    identity: tuple[int, int, int] | None = None  # the judged file's (inode, mtime ns, size)


def file_identity(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def remove_if_unchanged(path: Path, identity: tuple[int, int, int] | None) -> bool:
    """Delete ``path`` if it is still the file that was judged bad; False when a worker has replaced it
    since (a sample extracted again while the scan ran: its new file is not the bad one)."""
    try:
        if identity is None or file_identity(path) != identity:
            return False
    except FileNotFoundError:
        return False
    path.unlink(missing_ok=True)
    return True


def _check_hidden(item: tuple[int, Path], entry: ManifestEntry | None, *, deep: bool, cutoff: float,
                  layer_ids: list[int] | None) -> _Checked:
    sample_id, path = item
    identity = None
    try:
        identity = file_identity(path)
        if entry is not None:
            check_entry(path, entry, deep=deep)
            return _Checked(sample_id, path, "ok", entry=entry)
        if path.stat().st_mtime >= cutoff:
            return _Checked(sample_id, path, "fresh")
        info = verify_hidden_file(path, layer_ids=layer_ids)
        return _Checked(sample_id, path, "adopt", entry=ManifestEntry.from_info(sample_id, info))
    except FileNotFoundError:
        return _Checked(sample_id, path, "fresh")  # replaced or removed by its writer while we looked
    except (HiddenStateFileError, OSError) as exc:
        return _Checked(sample_id, path, "bad", reason=f"{error_class(exc)}: {exc}", identity=identity)


def _run_layers(spec: RunSpec, manifests: dict[Path, dict[int, ManifestEntry]]) -> list[int] | None:
    if spec.extraction.layer_ids is not None:
        return list(spec.extraction.layer_ids)
    for entries in manifests.values():
        for entry in entries.values():
            return entry.layer_ids
    return None


def scan_hidden(paths: RunPaths, spec: RunSpec, ids: RunIds, *, deep: bool, cutoff: float,
                report: ReconcileReport, refresh: Callable[[], None] = lambda: None) -> tuple[np.ndarray, int]:
    """(verified mask, bytes of verified files); bad files deleted, entry-less old files adopted or deleted."""
    files = [(i, p) for i, p in _sample_files(paths.hidden_dir, ".safetensors") if ids.is_prompt(i)]
    manifests = {shard: read_manifest(shard / MANIFEST_NAME) for shard in {p.parent for _, p in files}}
    layers = _run_layers(spec, manifests)
    def check(item: tuple[int, Path]) -> _Checked:
        return _check_hidden(item, manifests[item[1].parent].get(item[0]), deep=deep, cutoff=cutoff, layer_ids=layers)

    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        checked = _checked_in_order(pool, check, files, refresh)
    done, total = np.zeros(ids.rows, dtype=bool), 0
    for item in checked:
        if item.verdict == "adopt":
            append_entry(item.path.parent / MANIFEST_NAME, item.entry)
            report.adopted += 1
        if item.verdict in ("ok", "adopt"):
            done[item.sample_id], total = True, total + item.entry.bytes
        elif item.verdict == "bad" and remove_if_unchanged(item.path, item.identity):
            report.redone.append({"sample_id": item.sample_id, "stage": Stage.EXTRACT, "reason": item.reason})
            log.warning("run %s: sample %d: hidden-state file removed, to be extracted again: %s",
                        paths.run, item.sample_id, item.reason)
    return done, total


# ---- generate: reply files ----------------------------------------------------------------------


def reply_problem(path: Path, sample_id: int) -> str | None:
    """Why ``path`` is not the finished reply of ``sample_id``, or None when it is."""
    try:
        record = read_json(path)
    except FileNotFoundError:
        return "no reply file"
    except (OSError, ValueError) as exc:
        return f"unreadable reply file ({exc})"
    if not isinstance(record, dict) or record.get("sample_id") != sample_id:
        return "not the reply record of this sample"
    if not isinstance(record.get("messages"), list) or not isinstance(record.get("reply"), dict):
        return "reply record lacks its messages or reply"
    return None


def scan_generated(paths: RunPaths, ids: RunIds, extracted: np.ndarray, *, deep: bool, report: ReconcileReport,
                   refresh: Callable[[], None] = lambda: None) -> tuple[np.ndarray, int]:
    """(verified mask, bytes of verified replies); unreadable replies deleted."""
    files = [(i, p) for i, p in _sample_files(paths.generated_dir, ".json") if ids.is_prompt(i)]

    def check(item: tuple[int, Path]) -> str | None:
        sample_id, path = item
        return None if not deep and extracted[sample_id] and path.exists() else reply_problem(path, sample_id)

    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        problems = _checked_in_order(pool, check, files, refresh)
    done, total = np.zeros(ids.rows, dtype=bool), 0
    for (sample_id, path), problem in zip(files, problems):
        if problem is None:
            done[sample_id] = True
            total += path.stat().st_size
            continue
        path.unlink(missing_ok=True)
        report.redone.append({"sample_id": sample_id, "stage": Stage.GENERATE, "reason": problem})
        log.warning("run %s: sample %d: reply removed, to be generated again: %s", paths.run, sample_id, problem)
    return done, total


# ---- failures -----------------------------------------------------------------------------------


def read_failure_file(path: Path, run: str, stage: str, sample_id: int) -> Failure:
    """The record at ``path``; an unreadable one still names the sample (and says it was unreadable)."""
    try:
        record = read_json(path)
        return Failure(**{**record, "run": run, "stage": stage, "sample_id": sample_id})
    except (OSError, ValueError, TypeError) as exc:
        return Failure(run=run, stage=stage, sample_id=sample_id, error_class="UnreadableFailureRecord",
                       message=f"{path}: {exc}", at=time.time())


def scan_failures(paths: RunPaths, ids: RunIds, done: dict[str, np.ndarray],
                  report: ReconcileReport) -> dict[tuple[str, int], Failure]:
    """Failure records on the volume by (stage, id); those of samples that are done are removed."""
    found: dict[tuple[str, int], Failure] = {}
    for stage in SAMPLE_STAGES:
        directory = paths.failures_dir / stage
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            match = _STEM.match(path.stem)
            if not match:
                continue
            sample_id = int(match.group(1))
            if sample_id < ids.rows and done[stage][sample_id]:
                path.unlink(missing_ok=True)
                report.failures_cleared += 1
                continue
            found[(stage, sample_id)] = read_failure_file(path, paths.run, stage, sample_id)
    return found


def name_missing_rows(paths: RunPaths, ids: RunIds, failures: dict[tuple[str, int], Failure],
                      report: ReconcileReport) -> None:
    """Give every row that is in the run but nowhere on the volume a failure record of its own."""
    named = np.zeros(ids.rows, dtype=bool)
    for stage, sample_id in failures:
        if stage == Stage.GENERATE and sample_id < ids.rows:
            named[sample_id] = True
    for sample_id in np.flatnonzero(ids.expected & ~ids.prompts & ~named).tolist():
        exc = MissingPromptRow(f"row {sample_id} is not in prompts.jsonl and its failure record is lost "
                               "(the row was malformed when the run was submitted)")
        failure = Failure(run=paths.run, stage=Stage.GENERATE, sample_id=sample_id, error_class=error_class(exc),
                          message=str(exc), at=time.time())
        atomic_write_json(paths.failure(Stage.GENERATE, sample_id), asdict(failure))
        failures[(Stage.GENERATE, sample_id)] = failure
        report.named.append(sample_id)


# ---- publishing to Redis ------------------------------------------------------------------------


def merge_bitmap(conn: redis.Redis, key: str, scratch: str, mask: np.ndarray, still_set: Callable[[int], bool]) -> None:
    """Make bitmap ``key`` equal ``mask``, except for bits a worker set meanwhile.

    A set bit that the scan did not find is cleared only if ``still_set`` (asked after reading the
    bitmap) says the volume does not back it. Workers write the volume before Redis, so a bit set after
    that read is never cleared, and one set before it is backed by the volume by the time we ask."""
    current = bitmap_ids(conn.get(key))
    clear = [i for i in current if (i >= len(mask) or not mask[i]) and not still_set(i)]
    wanted = np.flatnonzero(mask)
    pipe = conn.pipeline()
    for sample_id in clear:
        pipe.setbit(key, sample_id, 0)
    if wanted.size:
        pipe.set(scratch, ids_bitmap(wanted.tolist()))
        pipe.bitop("OR", key, key, scratch)
        pipe.delete(scratch)
    pipe.execute()


def _hidden_still_done(paths: RunPaths) -> Callable[[int], bool]:
    manifests: dict[Path, dict[int, ManifestEntry]] = {}

    def check(sample_id: int) -> bool:
        path = paths.hidden(sample_id)
        if sample_id not in manifests.get(path.parent, {}):
            manifests[path.parent] = read_manifest(path.parent / MANIFEST_NAME)  # appended since the scan, maybe
        entry = manifests[path.parent].get(sample_id)
        try:
            return entry is not None and check_quick(path, entry) is None
        except HiddenStateFileError:
            return False

    return check


def _failure_still_recorded(paths: RunPaths, stage: str, kind: FailureKind) -> Callable[[int], bool]:
    def check(sample_id: int) -> bool:
        path = paths.failure(stage, sample_id)
        if not path.is_file():
            return False
        return _dropped(read_failure_file(path, paths.run, stage, sample_id)) == (kind is FailureKind.DROPPED)

    return check


def _dropped(failure: Failure) -> bool:
    """A drop; any other kind, one a hand-edited record names included, counts as an error."""
    return failure.kind == FailureKind.DROPPED


def publish(state: RunState, ids: RunIds, done: dict[str, np.ndarray],
            failures: dict[tuple[str, int], Failure]) -> None:
    """Bitmaps and failure records of the run in Redis, merged with what workers wrote meanwhile."""
    conn, paths, keys = state.conn, state.paths, state.keys
    checks = {Stage.EXTRACT: _hidden_still_done(paths),
              Stage.GENERATE: lambda sample_id: reply_problem(paths.generated(sample_id), sample_id) is None}
    for stage in SAMPLE_STAGES:
        merge_bitmap(conn, keys.outcome(stage, Outcome.DONE), keys.merge_scratch(stage, Outcome.DONE), done[stage],
                     checks[stage])
        for kind in FailureKind:
            mask = np.zeros(ids.rows, dtype=bool)
            for (s, sample_id), failure in failures.items():
                if s == stage and _dropped(failure) == (kind is FailureKind.DROPPED) and sample_id < ids.rows:
                    mask[sample_id] = True
            merge_bitmap(conn, keys.outcome(stage, kind.outcome), keys.merge_scratch(stage, kind.outcome), mask,
                         _failure_still_recorded(paths, stage, kind))
    _merge_failure_records(conn, paths, failures)
    _done_wins(state)


def _merge_failure_records(conn: redis.Redis, paths: RunPaths, failures: dict[tuple[str, int], Failure]) -> None:
    key = RunKeys(paths.run).failures
    wanted = {failure_field(stage, sample_id): f.to_json() for (stage, sample_id), f in failures.items()}
    stale = []
    for raw in conn.hkeys(key):
        name = raw.decode() if isinstance(raw, bytes) else raw
        stage, _, sample_id = name.partition(":")
        if name not in wanted and not (sample_id.isdigit() and paths.failure(stage, int(sample_id)).is_file()):
            stale.append(name)
    items = list(wanted.items())
    for start in range(0, len(items), 10_000):
        conn.hset(key, mapping=dict(items[start:start + 10_000]))
    if stale:
        conn.hdel(key, *stale)


def _done_wins(state: RunState) -> None:
    """A sample that is done has no failure: clear any record a race between merges left behind."""
    conn, keys = state.conn, state.keys
    for stage in SAMPLE_STAGES:
        done = set(bitmap_ids(conn.get(keys.outcome(stage, Outcome.DONE))))
        for outcome in (Outcome.FAILED, Outcome.DROPPED):
            for sample_id in done.intersection(bitmap_ids(conn.get(keys.outcome(stage, outcome)))):
                state.clear_failure(stage, sample_id)


# ---- meta ---------------------------------------------------------------------------------------


@dataclass
class Phase:
    """Where a rebuilt run stands: its phase, its whole-run stages' states and the meta fields beside them."""

    phase: RunPhase | None = None  # None: Redis's phase stands, or the stages below give it
    stages: dict[Stage, StageState] = field(default_factory=dict)  # moved in this order, each moving the phase
    fields: dict[str, object] = field(default_factory=dict)


def _phase_fields(state: RunState, meta: dict[str, str], now: float) -> Phase:
    """Where the run stands, from the volume first and from a live trainer's reports second; a phase that
    whole-run stages decide comes from the lifecycle's rule for them (``phase_of_stages``)."""
    paths = state.paths
    finished = read_finished(paths)
    if finished is not None:
        return Phase(RunPhase(finished["state"]), fields={"finished_at": finished["finished_at"],
                                                          **finished.get(FINISHED_META, {})})
    if paths.eval_report.is_file():
        report = read_json(paths.eval_report)
        return Phase(stages={Stage.TRAIN: StageState.DONE, Stage.EVALUATE: StageState.DONE},
                     fields={"train_enqueued_at": now, "export_path": str(paths.export_dir),
                             "acceptance_length": report.get("acceptance_length", "")})
    if "train_enqueued_at" in meta:
        return Phase()
    if any(k in meta for k in ("train_state", "train_done", "evaluate_state")):
        # A trainer kept reporting into a Redis that lost the run: it is working, so no second train job.
        stages = {stage: StageState.of(meta.get(f"{stage}_state")) for stage in WHOLE_RUN_STAGES}
        phase = phase_of_stages(stages, unverified=state.unverified()) or RunPhase.TRAINING
        return Phase(phase, fields={"train_enqueued_at": now})
    return Phase(RunPhase.GENERATING)


def restore_meta(state: RunState, spec: RunSpec, ids: RunIds, sizes: dict[str, int], report: ReconcileReport) -> None:
    meta = state.meta()
    report.registered = state.run not in known_runs(state.conn) or "expected" not in meta
    expected = int(np.count_nonzero(ids.expected))
    where = _phase_fields(state, meta, report.resumed_at)
    fields: dict[str, object] = {
        "dataset": spec.dataset, "train_ids": spec.train_ids,
        "holdout": int(np.count_nonzero(ids.held_out)), "prompts_bytes": ids.prompts_bytes,
        "feed_offset": 0, "fed_until": 0, "extract_cursor": 0, "resumed_at": report.resumed_at, **sizes,
        **where.fields,
    }
    if report.registered and sizes.get("generated_bytes"):
        fields[GENERATE_REQUESTS_UNCOUNTED] = 1  # the replies on the volume were asked before this Redis knew the run
    layers = _recorded_layers(state.paths)
    if "layer_ids" not in meta and layers is not None:
        fields.update(layer_ids=json.dumps(layers), layer_convention="decoder_output_0idx")
    if report.registered:
        state.register(expected, created_at=spec.created_at, **fields)
    else:
        state.set_meta(expected=expected, **fields)
    # The phase and stages are written after the rest: the reconcile lock keeps the supervisor and retries out.
    if where.phase is not None:
        state.set_phase(where.phase)
    for stage, new in where.stages.items():
        # A state Redis still holds is a live trainer's, later than the report on the volume; a lost one is restored.
        if f"{stage}_state" not in meta:
            state.set_stage(stage, new)
    state.conn.hdel(state.keys.meta, "feed_pass_at", "extract_pass_at")
    report.expected = expected
    report.state = str(state.phase())


def _recorded_layers(paths: RunPaths) -> list[int] | None:
    for shard in sorted(paths.hidden_dir.glob("rows_*")):
        for entry in read_manifest(shard / MANIFEST_NAME).values():
            return entry.layer_ids
    return None


# ---- the whole resume ---------------------------------------------------------------------------


def reconcile_run(data: Path, conn: redis.Redis, run: str, *, deep: bool = False,
                  grace_s: float = GRACE_S) -> ReconcileReport:
    """Rebuild ``run``'s Redis state from the volume; RunNotFound if the volume has no such run."""
    data = Path(data)
    spec = RunSpec.load(data, run)
    state = RunState(conn, data, run)
    paths = state.paths
    if not paths.prompts.is_file():
        # A run directory made without the controller (bench/bench_train_sweep.py's training-only variants
        # link a run's hidden states under a new name) or one whose prompt list was deleted.
        raise NoPromptList(f"run {run}: {paths.prompts} is missing, so the volume cannot say which samples the run "
                           "expects; a run made outside the controller (a training-only variant) is not rebuilt")
    with _reconcile_lock(conn, run) as refresh:
        report = ReconcileReport(run=run, deep=deep, resumed_at=time.time())
        cutoff = report.resumed_at - grace_s
        report.temp_removed = remove_stale_temps(paths, cutoff)
        ids = run_ids(paths, spec)
        extracted, hidden_bytes = scan_hidden(paths, spec, ids, deep=deep, cutoff=cutoff, report=report,
                                              refresh=refresh)
        generated, generated_bytes = scan_generated(paths, ids, extracted, deep=deep, report=report,
                                                    refresh=refresh)
        done = {Stage.GENERATE: generated, Stage.EXTRACT: extracted}
        failures = scan_failures(paths, ids, done, report)
        name_missing_rows(paths, ids, failures, report)
        refresh()
        publish(state, ids, done, failures)
        sizes = {"hidden_bytes": hidden_bytes, "generated_bytes": generated_bytes}
        restore_meta(state, spec, ids, sizes, report)
    report.generated, report.extracted = int(generated.sum()), int(extracted.sum())
    report.failures_kept = len(failures)
    log.info("run %s: reconciled: %s", run, report.summary())
    return report
