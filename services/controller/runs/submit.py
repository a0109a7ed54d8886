"""Submit a run: read the dataset once, write the normalized prompts, register the run's to-do list.

Held-out rule: the **last ``evaluate.holdout`` valid rows of the rows read** (after ``limit``) go to
``eval_prompts.jsonl`` and never through generate, extract or training. Their ids are the highest
valid ids, so ``train_ids`` (the first held-out id) splits the id range: every valid id below it is
trained on. Malformed rows are named generate-stage failures wherever they sit, also among or after
the held-out rows, so ``expected`` = sample ids − held-out rows.

With ``generation.replies`` = N > 1, each row before the first held-out one has N sample ids
(``GenerationConfig.sample_id``): its own, its row index, and N − 1 sampled ones. ``prompts.jsonl`` then
holds the rows' own lines first, as with one reply, then each sampled block's lines (the same messages
under the sampled ids), so ids rise through the file and every prompt's own reply is generated before any
sampled one; a malformed row fails each of its ids; the held-out rows' ids move up past the sampled ones.
Where those ids fall is known only once the whole dataset is read (the held-out rows are its last valid
ones), so bad rows are recorded after the read.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import redis

from services.controller.runs.datasets import iter_rows
from shared.atomic import atomic_write
from shared.errors import DatasetError, RowError, RunExists, error_class
from shared.layout import RunPaths, check_run_name
from shared.lifecycle import Failure, RunKeys, RunPhase, Stage
from shared.runspec import GenerationConfig, RunSpec
from runtime.runstate import RunState, known_runs

log = logging.getLogger(__name__)

SUBMIT_LOCK_TTL_S = 3600


def prompt_line(sample_id: int, messages: list[dict]) -> bytes:
    return (json.dumps({"sample_id": sample_id, "messages": messages}, ensure_ascii=False) + "\n").encode("utf-8")


def default_run_name(dataset: str) -> str:
    """``<dataset stem>-<UTC timestamp>``, reduced to the characters a run name allows."""
    stem = Path(dataset.rstrip("/")).name.split(".")[0] or "run"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._")[:60] or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


# prompts.jsonl lines start with the id (prompt_line), so a sampled reply's line is its row's with the id changed.
_ID_PREFIX = re.compile(rb'^\{"sample_id": (\d+)(?=[,}])')


@dataclass
class _Split:
    """What streaming the dataset produced."""

    rows: int = 0
    valid: int = 0
    first_problem: str = ""
    holdout: deque = field(default_factory=deque)
    bad: list[tuple[int, RowError]] = field(default_factory=list)  # (row, why), recorded once the ids are known

    @property
    def prompt_rows(self) -> int:
        """Rows before the first held-out one (all of them when none is held out)."""
        return self.holdout[0][0] if self.holdout else self.rows


def submit_run(data: Path, conn: redis.Redis, spec: RunSpec) -> RunSpec:
    """Create run ``spec.name`` from ``spec.dataset``; RunExists if it exists, DatasetError if nothing can be
    read. The spec saved is this one with the rows counted and the training ids split from the held out."""
    data, name = Path(data), check_run_name(spec.name)
    with submission_lock(conn, name):
        _refuse_existing(data, conn, name)
        paths, state = RunPaths(data, name), RunState(conn, data, name)
        try:
            return _create(spec, paths, state)
        except BaseException:
            _discard(paths, state)
            raise


def _create(spec: RunSpec, paths: RunPaths, state: RunState) -> RunSpec:
    result = _write_prompts(spec, paths)
    extra = (spec.generation.replies - 1) * result.prompt_rows  # the sampled replies' ids
    spec = spec.model_copy(update={"rows": result.rows + extra, "train_ids": result.prompt_rows + extra})
    held_out = [prompt_line(spec.generation.sample_id(i, spec.prompt_rows), m) for i, m in result.holdout]
    atomic_write(paths.eval_prompts, lambda handle: handle.writelines(held_out))
    for row, exc in result.bad:  # before run.json: a run on the volume has every bad row named
        _record_bad_row(state, spec, row, exc)
    spec.save(paths.data)
    expected = spec.rows - len(result.holdout)
    state.register(
        expected, state=RunPhase.GENERATING, dataset=spec.dataset, train_ids=spec.train_ids,
        holdout=len(result.holdout), feed_offset=0, fed_until=0, prompts_bytes=paths.prompts.stat().st_size,
        hidden_bytes=0, generated_bytes=0,
    )
    log.info("run %s: %d rows, %d valid, %d held out, %d replies per training prompt, %d expected", spec.name,
             result.rows, result.valid, len(result.holdout), spec.generation.replies, expected)
    return spec


def _write_prompts(spec: RunSpec, paths: RunPaths) -> _Split:
    """Read the dataset once into ``prompts.jsonl`` (with the sampled replies' lines where the run asks for them);
    what the read found."""
    rows = iter_rows(spec.dataset, split=spec.split, limit=spec.limit)
    result = _Split(holdout=deque())
    atomic_write(paths.prompts, lambda handle: _stream_prompts(rows, handle, result, spec.evaluate.holdout))
    _check_usable(spec, result)
    if spec.generation.replies > 1:
        atomic_write(paths.prompts,
                     lambda handle: _add_sampled_lines(paths, handle, spec.generation, result.prompt_rows))
    return result


def _stream_prompts(rows: Iterable, handle: BinaryIO, result: _Split, holdout: int) -> None:
    """Write valid rows to ``handle``, keeping the last ``holdout`` of them back; keep every bad row to name."""
    for sample_id, item in rows:
        result.rows += 1
        if isinstance(item, RowError):
            result.bad.append((sample_id, item))
            if not result.first_problem:
                result.first_problem = f"row {sample_id}: {error_class(item)}: {item}"
            continue
        result.valid += 1
        result.holdout.append((sample_id, item))
        if len(result.holdout) > holdout:
            handle.write(prompt_line(*result.holdout.popleft()))


def _add_sampled_lines(paths: RunPaths, handle: BinaryIO, generation: GenerationConfig, prompt_rows: int) -> None:
    """The published prompts (each row's own line), then each sampled reply's block: the same lines, each under
    the id ``GenerationConfig.sample_id`` gives that reply, so ids rise through the file."""
    for reply in range(generation.replies):
        with open(paths.prompts, "rb") as lines:
            for line in lines:
                handle.write(line if reply == 0 else _sampled_line(line, generation, prompt_rows, reply))


def _sampled_line(line: bytes, generation: GenerationConfig, prompt_rows: int, reply: int) -> bytes:
    """A row's prompt line under the id of its sampled reply ``reply``; the messages' bytes stay as written."""
    prefix = _ID_PREFIX.match(line)
    return b'{"sample_id": %d' % generation.sample_id(int(prefix.group(1)), prompt_rows, reply) + line[prefix.end():]


def _record_bad_row(state: RunState, spec: RunSpec, row: int, exc: RowError) -> None:
    """Name the bad row at each of its sample ids: its own, and with replies > 1 its sampled ones."""
    generation, prompt_rows = spec.generation, spec.prompt_rows
    replies = generation.replies if row < prompt_rows else 1
    for reply in range(replies):
        failure = Failure(run=state.run, stage=Stage.GENERATE, sample_id=generation.sample_id(row, prompt_rows, reply),
                          error_class=error_class(exc), message=generation.reply_label(row, reply) + str(exc))
        state.mark_failed(failure, count_in_rate=False)


def _check_usable(spec: RunSpec, result: _Split) -> None:
    if result.valid == 0:
        detail = f"; first problem: {result.first_problem}" if result.first_problem else ""
        raise DatasetError(
            f"dataset {spec.dataset!r} (split {spec.split!r}): no valid rows among {result.rows} read{detail}"
        )
    if result.valid <= spec.evaluate.holdout:
        raise DatasetError(
            f"dataset {spec.dataset!r} has {result.valid} valid rows; holding out {spec.evaluate.holdout} for "
            "evaluation leaves none to train on (lower evaluate.holdout or read more rows)"
        )


def _refuse_existing(data: Path, conn: redis.Redis, name: str) -> None:
    if RunPaths(data, name).spec.exists() or name in known_runs(conn):
        raise RunExists(f"run {name!r} already exists; choose another name")


def _discard(paths: RunPaths, state: RunState) -> None:
    """Remove what a failed submission left behind (never a published run: those are refused earlier)."""
    state.delete()
    if paths.root.is_dir() and not paths.spec.exists():
        shutil.rmtree(paths.root, ignore_errors=True)


@contextmanager
def submission_lock(conn: redis.Redis, name: str) -> Iterator[None]:
    """Two submissions of one name race between the existence check and registration; one waits out. The
    supervisor also leaves a run under this lock alone (``lost_runs``): its directory may be on the volume
    before Redis knows it, and the submitter registers it."""
    key = RunKeys(name).submit_lock
    if not conn.set(key, str(time.time()), nx=True, ex=SUBMIT_LOCK_TTL_S):
        raise RunExists(f"run {name!r} is being submitted right now")
    try:
        yield
    finally:
        conn.delete(key)
