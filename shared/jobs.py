"""Job contracts: queue names, payloads with a schema version, deterministic job ids.

Payloads cross Redis as JSON (RQ's JSONSerializer), never pickle. A job function takes exactly one
argument, the payload dict, and validates it with the model below.
"""

from __future__ import annotations

import hashlib
import re

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared import SCHEMA_VERSION

GENERATE_QUEUE = "draftline-generate"
EXTRACT_QUEUE = "draftline-extract"
TRAIN_QUEUE = "draftline-train"
QUEUES = (GENERATE_QUEUE, EXTRACT_QUEUE, TRAIN_QUEUE)

# Dotted paths RQ imports in the worker; the controller and generator never import the heavy modules.
GENERATE_FUNC = "services.generator.jobs.generate"
EXTRACT_FUNC = "services.extractor.jobs.extract"
TRAIN_FUNC = "services.trainer.jobs.train"
EVALUATE_FUNC = "services.trainer.jobs.evaluate"
# The one table of what a worker runs: a job naming any other function (an RQ job names the callable to
# import and call, so a foreign one would be code execution by anyone who can write to Redis) fails as
# ForeignJob without running.
JOB_FUNCS: dict[str, frozenset[str]] = {
    GENERATE_QUEUE: frozenset({GENERATE_FUNC}),
    EXTRACT_QUEUE: frozenset({EXTRACT_FUNC}),
    TRAIN_QUEUE: frozenset({TRAIN_FUNC, EVALUATE_FUNC}),
}

# RQ 3 refuses job ids with other characters (":" and "." included).
_RQ_ID_CHARS = re.compile(r"[A-Za-z0-9_-]+")
_RQ_ID_BAD = re.compile(r"[^A-Za-z0-9_-]")


class _Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: int = SCHEMA_VERSION
    run: str


class PromptItem(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    sample_id: int = Field(..., ge=0)
    messages: list[dict]


class GenerateJob(_Payload):
    items: list[PromptItem] = Field(..., min_length=1)


# Samples per extract job. RQ forks a work horse (~340 MB) and issues ~91 Redis commands of bookkeeping per
# job (bench/RESULTS.md), so one sample a job caps an extractor near 15 samples/s and one Redis near 250
# samples/s. 16, the generate batch the bench measures, brings the bookkeeping to ~6 commands a sample; a
# larger batch saves at most that much more, while a run's last jobs give more samples to fewer workers and
# a job's hour (EXTRACT_JOB_TIMEOUT_S) must cover every sample of it.
DEFAULT_EXTRACT_BATCH = 16
MAX_EXTRACT_BATCH = 256


class ExtractJob(_Payload):
    sample_ids: list[Annotated[int, Field(ge=0)]] = Field(..., min_length=1, max_length=MAX_EXTRACT_BATCH)

    @model_validator(mode="before")
    @classmethod
    def _one_sample(cls, data: object) -> object:
        # A payload naming one ``sample_id`` (what a queue filled before batches holds) is a batch of one.
        if isinstance(data, dict) and "sample_id" in data and "sample_ids" not in data:
            data = {**{k: v for k, v in data.items() if k != "sample_id"}, "sample_ids": [data["sample_id"]]}
        return data

    @field_validator("sample_ids")
    @classmethod
    def _increasing(cls, ids: list[int]) -> list[int]:
        # Sorted and without repeats: a sample is extracted once per job, and the job id names the first.
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError("sample_ids must be strictly increasing")
        return ids


class TrainJob(_Payload):
    pass


class EvaluateJob(_Payload):
    pass


def payload_sample_ids(payload: dict) -> list[int]:
    """The sample ids a generate or extract payload holds, read without validating it: the payload of a
    failed job, or of one queued by another version, may not validate."""
    ids = [item["sample_id"] for item in payload.get("items") or () if isinstance(item, dict) and "sample_id" in item]
    ids += list(payload.get("sample_ids") or ())
    ids += [payload["sample_id"]] if "sample_id" in payload else []
    return [int(i) for i in ids]


def rq_safe(run: str) -> str:
    """``run`` as RQ 3 accepts it inside a job id (letters, digits, ``_`` and ``-`` only).

    A run name with a ``.`` gets its dots replaced and a short digest of the real name appended, so two
    runs never share a job id."""
    if _RQ_ID_CHARS.fullmatch(run):
        return run
    digest = hashlib.sha256(run.encode("utf-8")).hexdigest()[:8]
    return f"{_RQ_ID_BAD.sub('_', run)}_{digest}"


# How long RQ keeps a sample job once it ended. Redis is the to-do list and the volume the truth: a
# sample's outcome lies in its files and the run's bitmaps, and nothing in the pipeline reads a finished
# sample job, so by default none is kept (0: RQ deletes the job as it succeeds, and puts it in no finished
# registry). A kept one costs about 7 KB of Redis per sample (bench/RESULTS.md: 7,671 B after a run that kept
# them an hour, 860 B without; the waiting to-do list is about 1.9 KB per extract job), plus a finished-
# registry entry until RQ's maintenance drops it (every 10 minutes). At 140 samples/s (8 GPUs) an hour is
# 500k samples, about 3.5 GB; at 1,000 samples/s each second kept is about 7 MB, so 256 MB would allow a TTL
# of about 30 s and no more, and less with long prompts (a generate job holds its prompts). Deleting at once
# keeps Redis near 10 MB at any rate, for about 8 more Redis commands per job (RQ's delete path). Services
# read the value as DRAFTLINE_SAMPLE_RESULT_TTL_S (shared.settings.SampleQueueSettings); a test that looks at
# finished jobs sets it longer. A failed job stays a week: failures.py names its samples on the volume from
# it, then deletes it.
DEFAULT_SAMPLE_RESULT_TTL_S = 0
SAMPLE_FAILURE_TTL_S = 7 * 24 * 3600
# A run's train and evaluate jobs, one of each per run, keep their record a week whichever way they ended.
RUN_JOB_TTL_S = 7 * 24 * 3600
TRAIN_JOB_TIMEOUT = -1  # RQ's "never": training runs for hours and reports its own progress
EVALUATE_JOB_TIMEOUT_S = 6 * 3600


def generate_job_id(run: str, first_sample_id: int) -> str:
    return f"generate_{rq_safe(run)}_{first_sample_id:08d}"


def extract_job_id(run: str, first_sample_id: int) -> str:
    """The id of the extract job whose batch starts at ``first_sample_id`` (a batch of one: that sample's)."""
    return f"extract_{rq_safe(run)}_{first_sample_id:08d}"


def train_job_id(run: str) -> str:
    return f"train_{rq_safe(run)}"


def evaluate_job_id(run: str) -> str:
    return f"evaluate_{rq_safe(run)}"
