"""Job contracts: queue names, payloads with a schema version, deterministic job ids.

Payloads cross Redis as JSON (RQ's JSONSerializer), never pickle. A job function takes exactly one
argument, the payload dict, and validates it with the model below.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

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

STAGES = ("generate", "extract", "train", "evaluate")
SAMPLE_STAGES = ("generate", "extract")


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


class ExtractJob(_Payload):
    sample_id: int = Field(..., ge=0)


class TrainJob(_Payload):
    pass


class EvaluateJob(_Payload):
    pass


def generate_job_id(run: str, first_sample_id: int) -> str:
    return f"generate:{run}:{first_sample_id:08d}"


def extract_job_id(run: str, sample_id: int) -> str:
    return f"extract:{run}:{sample_id:08d}"


def train_job_id(run: str) -> str:
    return f"train:{run}"


def evaluate_job_id(run: str) -> str:
    return f"evaluate:{run}"
