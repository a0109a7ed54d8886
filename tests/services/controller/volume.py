"""A run's volume as workers would have left it, built by hand for tests of resume and feeding.

Replies and hidden-state files are real files in the real formats (a hidden-state file here passes
``verify_hidden_file``), just small: tests of thousands of samples need no server to make them.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import redis
from rq.job import Job, JobStatus
from safetensors.numpy import save

from services.controller.runs.submit import submit_run
from shared import SCHEMA_VERSION, eagle3
from shared.layout import RunPaths
from shared.manifest import MANIFEST_NAME, ManifestEntry
from shared.runspec import EvalConfig, RunSpec
from runtime.queues import SERIALIZER
from runtime.runstate import RunState, write_finished
from runtime.sample_queue import enqueue_train
from shared.jobs import train_job_id
from shared.lifecycle import RunPhase, Stage, StageState
from tests.services.controller.runs.test_datasets import write_jsonl

LAYERS = [1, 3, 4]


def submit(data: Path, conn: redis.Redis, tmp_path: Path, name: str, rows: list, *, holdout: int = 1,
           **config) -> RunState:
    """Submit ``rows`` as run ``name`` (``config``: generation=..., extraction=..., as submit_run takes)."""
    dataset = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    config.setdefault("evaluate", EvalConfig(holdout=holdout))
    submit_run(data, conn, RunSpec(dataset=str(dataset), name=name, model="m", **config))
    return RunState(conn, data, name)


def prompt_rows(n: int, bad: tuple[int, ...] = ()) -> list:
    return ["{bad" if i in bad else {"prompt": f"q{i}"} for i in range(n)]


def write_reply(paths: RunPaths, sample_id: int) -> Path:
    path = paths.generated(sample_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "schema_version": SCHEMA_VERSION, "sample_id": sample_id,
        "messages": [{"role": "user", "content": f"q{sample_id}"}],
        "reply": {"content": f"answer {sample_id}", "reasoning_content": None},
        "usage": {"completion_tokens": 2}, "finish_reason": "stop", "model": "m",
    }))
    return path


def hidden_bytes(sample_id: int, tokens: int = 4, hidden: int = 4) -> bytes:
    rng = np.random.default_rng(sample_id)
    tensors = {
        eagle3.INPUT_IDS: np.arange(tokens, dtype=np.int64),
        eagle3.LOSS_MASK: np.ones(tokens, dtype=np.uint8),
        eagle3.AUX_HIDDEN: rng.standard_normal((tokens, 3 * hidden)).astype(np.float16),
        eagle3.LAST_HIDDEN: rng.standard_normal((tokens, hidden)).astype(np.float16),
    }
    metadata = {eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE, eagle3.META_LAYER_IDS: json.dumps(LAYERS),
                eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION}
    return save(tensors, metadata=metadata)


def write_hidden(paths: RunPaths, sample_id: int, tokens: int = 4) -> ManifestEntry:
    """A valid hidden-state file; returns the manifest entry an extractor would have written for it."""
    raw = hidden_bytes(sample_id, tokens)
    path = paths.hidden(sample_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return ManifestEntry(sample_id=sample_id, sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw),
                         num_tokens=tokens, dtype="F16", layer_ids=LAYERS, at=1.0)


def write_manifest(paths: RunPaths, entries: list[ManifestEntry]) -> None:
    """Many entries at once (what many ``append_entry`` calls leave, without an fsync per line)."""
    for entry in entries:
        path = paths.hidden(entry.sample_id).parent / MANIFEST_NAME
        with open(path, "ab") as handle:
            handle.write(entry.to_line())


def finish_samples(state: RunState, *, generated: range | list, extracted: range | list) -> None:
    """Replies for ``generated``, verified hidden states with manifest entries for ``extracted``."""
    for sample_id in generated:
        write_reply(state.paths, sample_id)
    write_manifest(state.paths, [write_hidden(state.paths, i) for i in extracted])


def fail_training(state: RunState, *, checkpoints: tuple[int, ...]) -> None:
    """A run whose samples all settled, whose training wrote ``checkpoints`` and then failed, finished as failed."""
    finish_samples(state, generated=range(4), extracted=range(4))
    state.set_meta(train_enqueued_at=time.time())
    state.set_stage(Stage.TRAIN, StageState.RUNNING)
    for step in checkpoints:
        state.paths.checkpoint(step).mkdir(parents=True)
    state.set_stage(Stage.TRAIN, StageState.FAILED, train_error="OSError: [Errno 28] No space left on device")
    write_finished(state, RunPhase.FAILED)
    enqueue_train(state.conn, state.run)
    job = Job.fetch(train_job_id(state.run), connection=state.conn, serializer=SERIALIZER)
    job.set_status(JobStatus.FAILED)  # what RQ leaves of a job that raised
