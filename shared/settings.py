"""Typed settings for every service, read from the environment (and a ``.env`` file when present).

Each service builds its settings once at start-up through ``load_settings(cls)``; an invalid value stops
the service with a message naming the variable, and so does a ``DRAFTLINE_`` variable that no draftline
component reads (a misspelt name would otherwise leave its setting at the default unnoticed). Nothing is
created at import time, so tests construct settings with explicit values.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, DotEnvSettingsSource, SettingsConfigDict

from shared.endpoints import EndpointList
from shared.errors import SettingsError, UnknownSetting
from shared.jobs import DEFAULT_EXTRACT_BATCH, DEFAULT_SAMPLE_RESULT_TTL_S, MAX_EXTRACT_BATCH

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_INFERENCE_URL = "http://127.0.0.1:8000"
LOOPBACK = "127.0.0.1"
# A shorter token is guessable; 32 random bytes in URL-safe base64 are 43 characters.
MIN_TOKEN_CHARS = 16
TRUST_REMOTE_CODE_HELP = (
    "Run the Python code the target directory ships for its tokenizer or model (auto_map in tokenizer_config.json "
    "or config.json; Kimi-K2.5's tokenizer is such code). Only for a target directory you trust."
)


class ServiceSettings(BaseSettings):
    """What every service needs: the volume and logging."""

    model_config = SettingsConfigDict(env_prefix="DRAFTLINE_", env_file=".env", extra="ignore")

    data: Path = Field(Path("./data"), description="Root of the shared data volume (runs, models).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class CommonSettings(ServiceSettings):
    """A service that uses Redis: the queues, counters and run state."""

    redis_url: str = Field(
        DEFAULT_REDIS_URL,
        validation_alias="REDIS_URL",
        description="Redis holding the queues and counters; workers on other hosts point here.",
    )


class SampleQueueSettings(CommonSettings):
    """A service that queues sample jobs: the controller (generate jobs, missing extractions) and the
    generator (its replies' extraction)."""

    sample_result_ttl_s: int = Field(
        DEFAULT_SAMPLE_RESULT_TTL_S, ge=0,
        description="Seconds RQ keeps a finished generate or extract job in Redis; 0 deletes it at once. Nothing "
        "reads it; each second kept costs about 7 KB per sample finished in it (shared.jobs). Failed jobs "
        "stay a week regardless.",
    )
    extract_batch: int = Field(
        DEFAULT_EXTRACT_BATCH, ge=1, le=MAX_EXTRACT_BATCH,
        description="Most samples per extract job; RQ's fork and bookkeeping are paid once per job (shared.jobs).",
    )


class InferenceSettings(ServiceSettings):
    """The built-in model server: chat completions and hidden-state extraction. It uses no Redis."""

    model_dir: Path = Field(..., description="Local Hugging Face model directory of the target.")
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    model_name: str | None = Field(None, description="Name served in /v1/models; defaults to the directory name.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    host: str = Field(LOOPBACK, description="Listen address; compose sets 0.0.0.0 inside the container.")
    port: int = Field(8000, ge=1, le=65535)
    max_batch_size: int = Field(16, ge=1, description="Most chat requests decoded together.")
    batch_wait_ms: float = Field(5.0, ge=0, description="How long a batch waits to fill before it starts.")
    hidden_batch_tokens: int = Field(16384, ge=1, description="Token budget of one hidden-state forward pass.")
    writer_threads: int = Field(4, ge=1, description="Threads writing hidden-state files while the GPU works.")
    decoder: Literal["auto", "continuous", "per-batch"] = Field(
        "auto", description="Chat decoding: continuous batching in fixed KV slots, or one batch at a time; auto "
        "takes continuous on CUDA for a target it runs (Llama, Mistral, Qwen2/3), per-batch otherwise.")
    decode_slots: int = Field(256, ge=1, description="Most requests the continuous decoder decodes at once.")
    slot_tokens: int = Field(4096, ge=2, description="Positions (prompt and reply) of one continuous-decoder slot; a "
                             "longer request is decoded alone by the per-batch decoder.")
    long_slots: int = Field(4, ge=0, description="Continuous-decoder slots for requests longer than slot_tokens, "
                            "stepped beside the others; 0: such a request is decoded alone, holding the others up.")
    long_slot_tokens: int = Field(0, ge=0, description="Positions of a long slot; 0 takes the target's context "
                                  "length, at most 32768.")
    kv_cache_fraction: float = Field(0.35, gt=0, le=0.9, description="Most of the GPU memory free after loading "
                                     "that the continuous decoder's KV slots take; fewer slots when they would not fit.")
    prefill_tokens: int = Field(16384, ge=1, description="Padded prompt tokens the continuous decoder prefills at once.")
    cuda_graphs: bool = Field(True, description="Capture the continuous decoder's step as CUDA graphs.")


class ControllerSettings(SampleQueueSettings):
    """HTTP API, run submission, the queue feeder and the status page."""

    host: str = Field(LOOPBACK, description="Listen address; any other than loopback needs api_token.")
    port: int = Field(8080, ge=1, le=65535)
    inference_url: EndpointList = Field(
        DEFAULT_INFERENCE_URL, description="Generation server(s), comma-separated base URLs; asked for the model "
        "name when a run names none, and checked by preflight (every one must serve the same model)."
    )
    feed_window: int = Field(64, ge=1, description="Most generate jobs waiting in Redis per run.")
    # 512 jobs of 16 samples hold about 8 MB of Redis (bench/RESULTS.md: 15.5 KB a waiting job), what 4,096
    # jobs of one sample held, and twice as many samples.
    extract_backlog: int = Field(
        512, ge=1, description="Generation pauses while this many extract jobs wait (each holds up to extract_batch "
        "samples).")
    feed_interval_s: float = Field(1.0, gt=0)
    generate_batch: int = Field(8, ge=1, description="Samples per generate job.")
    model_dir: Path | None = Field(
        None, description="Target model directory; preflight compares its fingerprint with the served model's."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device the GPU services are set to; with cuda, preflight requires a visible GPU."
    )
    disk_reserve_bytes: int = Field(
        1 << 30, ge=0, description="Free bytes a run never plans to use; extraction pauses before eating into them."
    )
    disk_reserve_fraction: float = Field(
        0.01, ge=0, lt=1, description="Reserve as a fraction of the volume; the larger of the two reserves applies."
    )
    allow_ephemeral_data: bool = Field(
        False, description="Accept a data volume on tmpfs or under /tmp (demo only: it is lost at reboot)."
    )
    api_token: SecretStr | None = Field(
        None, description="Bearer token every mutating API call must send (and every read, with api_reads=token).",
    )
    api_reads: Literal["open", "token"] = Field(
        "open", description="Whether GET calls and the status page are open or need api_token too (/health is open).",
    )
    allow_unauthenticated: bool = Field(
        False, description="Start without api_token although the listen address is not loopback.",
    )
    dataset_roots: str = Field(
        "", description="Folders a run's local dataset must lie in, comma-separated; default <data>/datasets.",
    )

    @field_validator("api_token", mode="before")
    @classmethod
    def _token(cls, value: object) -> object:
        # An empty line in .env means no token, not a token anyone can send.
        if value is None or value == "":
            return None
        text = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        if len(text) < MIN_TOKEN_CHARS or text != text.strip():
            raise ValueError(f"use at least {MIN_TOKEN_CHARS} characters without surrounding blanks, e.g. the "
                             "output of `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        return text

    @field_validator("dataset_roots")
    @classmethod
    def _roots(cls, value: str) -> str:
        entries = [entry.strip() for entry in value.split(",")] if value.strip() else []
        if any(not entry for entry in entries):
            raise ValueError("an entry is empty (expected folders separated by commas)")
        return ",".join(entries)

    def dataset_root_paths(self) -> tuple[Path, ...]:
        """The folders local datasets are read from, symlinks and ``..`` resolved."""
        roots = [Path(entry) for entry in self.dataset_roots.split(",")] if self.dataset_roots else []
        return tuple(root.resolve() for root in roots or [Path(self.data) / "datasets"])


class RetrySettings(CommonSettings):
    """How a worker retries the inference server, and how long it waits while the server is down or full."""

    retry_max_attempts: int = Field(4, ge=1, description="Attempts of one request on transient trouble (1: no retry).")
    retry_base_delay_s: float = Field(1.0, gt=0, description="First retry delay; it doubles per retry (full jitter).")
    retry_max_delay_s: float = Field(30.0, gt=0, description="Longest delay between retries or /health polls.")
    inference_wait_max_s: float = Field(
        2400.0, ge=0,
        description="Longest one request waits for a down or full inference server before its sample fails; "
        "0 never waits. Kept under the 1 h extract-job timeout so a sample fails named, not killed.",
    )


class SampleWorkerSettings(RetrySettings):
    """A worker of sample jobs (generate, extract): how it runs each job."""

    job_process: Literal["fork", "inline"] = Field(
        "inline", description="inline: each job runs in the worker's own process, its clients and caches kept "
        "between jobs (bench/RESULTS.md: the fork and its start-up were most of a sample's cost); fork: each job "
        "in a forked work horse, RQ's default (runtime.worker says what each keeps).")


class GeneratorSettings(SampleWorkerSettings, SampleQueueSettings):
    """RQ worker that asks the inference server (built-in, vLLM or SGLang) for the target's replies."""

    inference_url: EndpointList = Field(
        DEFAULT_INFERENCE_URL, description="Generation server(s): one base URL or several, comma-separated; "
        "requests are spread over them and fail over when one is down."
    )
    concurrency: int = Field(8, ge=1, description="Requests in flight per generator worker.")
    request_timeout_s: float = Field(600.0, gt=0)


class ExtractorSettings(SampleWorkerSettings):
    """RQ worker that turns replies into token ids and gets their hidden states (built-in server or vLLM)."""

    hidden_states_url: EndpointList = Field(
        DEFAULT_INFERENCE_URL, description="Built-in server(s) for hidden states: one base URL or several, "
        "comma-separated; requests are spread over them and fail over when one is down."
    )
    model_dir: Path = Field(..., description="Target model directory (its tokenizer and chat template).")
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    request_timeout_s: float = Field(600.0, gt=0)
    hidden_source: Literal["builtin", "vllm"] = Field(
        "builtin", description="Who computes hidden states: the built-in server, or a vLLM server running the "
        "extract_hidden_states method (hidden_states_url then names the vLLM server or servers).")
    vllm_storage: Path | None = Field(
        None, description="vLLM source: the directory its connector writes to (shared_storage_path), as this "
        "worker sees it; files are read and deleted there, never elsewhere.")
    vllm_saved_layers: list[int] | None = Field(
        None, description="vLLM source: the layer ids (vLLM's numbering) the server saves, as in its "
        "eagle_aux_hidden_state_layer_ids; unset, the target's default auxiliary layers and the last one.")


class TrainerSettings(CommonSettings):
    """RQ worker that trains, exports and evaluates drafters."""

    model_dir: Path = Field(..., description="Target model directory (embeddings, lm_head, evaluation).")
    trust_remote_code: bool = Field(False, description=TRUST_REMOTE_CODE_HELP)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    train_procs: int | Literal["auto"] = Field(
        "auto",
        description="Training processes (DDP ranks, one per GPU) a train job starts through torchrun; auto: one "
        "per visible GPU, 1 on the CPU. 1 trains inside the worker.",
    )

    train_node: Literal["job", "join"] = Field(
        "job", description="job: this trainer runs the train queue's jobs (a multi-node training's job host). join: "
        "it runs no jobs; it joins, with train_procs ranks, every multi-node training a train job announces in "
        "Redis (a second training host).",
    )
    train_nodes: int = Field(
        1, ge=1, description="Hosts that train one run together, each starting train_procs ranks through torchrun's "
        "c10d rendezvous at train_rdzv_endpoint: the train job's host and train_nodes - 1 trainers with "
        "train_node=join. Set on the job's host.",
    )
    train_rdzv_endpoint: str | None = Field(
        None, description="host:port of the rendezvous when train_nodes > 1: an address of the train job's host "
        "that every node reaches (its agent hosts the rendezvous store there).",
    )
    train_node_addr: str | None = Field(
        None, description="This host's address as the other nodes reach it (torchrun's --local-addr); unset: "
        "torchrun looks up the host name, which must then resolve to such an address on every node.",
    )
    train_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the other nodes to join a multi-node training, and for one "
        "collective operation of it: a node that died fails the training by name within this, instead of hanging.",
    )

    eval_procs: int = Field(
        1, ge=1, description="Processes an evaluate job decodes in, each with its own copy of target and drafter; "
        "each decodes its share as one batch; several use more CPU cores, one suits a GPU.",
    )
    eval_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The target's dtype during evaluation; float32 keeps the greedy-equality check tight.",
    )
    eval_vllm_command: str | None = Field(
        None, description="The command that starts vLLM's OpenAI server, split as a shell would (e.g. "
        "'/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server'); draftline adds the target, a loopback port "
        "and the export as the EAGLE-3 drafter at the run's draft_steps. When set, every evaluation also serves the "
        "export through it and reports vLLM's own acceptance length beside the evaluator's, on the same prompts.",
    )
    eval_vllm_args: str = Field(
        "", description="More arguments for that server, split as a shell would ('--dtype float32 --enforce-eager' "
                        "on a CPU, where float32 keeps the greedy texts comparable).")
    eval_vllm_prompts: int = Field(
        16, ge=1, description="Prompts of the headline evaluation set that vLLM decodes, one at a time, from the first.")
    eval_vllm_tolerance: float = Field(
        0.05, ge=0, description="How far vLLM's acceptance length may lie from the evaluator's on the same prompts "
                                "before the evaluation fails (EngineAcceptanceMismatch).")
    eval_vllm_start_timeout_s: float = Field(900.0, gt=0, description="Longest wait for that server's /health.")

    @model_validator(mode="after")
    def _rendezvous(self) -> TrainerSettings:
        if self.train_nodes > 1 and not self.train_rdzv_endpoint:
            raise ValueError(f"DRAFTLINE_TRAIN_NODES={self.train_nodes} needs DRAFTLINE_TRAIN_RDZV_ENDPOINT (host:port "
                             "of the rendezvous on the train job's host)")
        host, _, port = (self.train_rdzv_endpoint or "").rpartition(":")
        if self.train_rdzv_endpoint and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"DRAFTLINE_TRAIN_RDZV_ENDPOINT={self.train_rdzv_endpoint!r} is not host:port")
        return self

    @field_validator("train_procs", mode="before")
    @classmethod
    def _procs(cls, value: object) -> object:
        # One message for both spellings, instead of one error per member of the union.
        if value == "auto" or (str(value).isdigit() and int(str(value)) >= 1):
            return value
        raise ValueError(f"{value!r} is neither 'auto' nor a whole number of at least 1")


class ExporterSettings(CommonSettings):
    """Prometheus endpoint over Redis counters and the volume."""

    host: str = Field(LOOPBACK, description="Listen address; compose sets 0.0.0.0 inside the container.")
    port: int = Field(9400, ge=1, le=65535)


# The settings class ``draftline serve <name>`` builds. Compose hands each container exactly the variables of
# its class (tests/test_compose.py checks both), so no container holds a secret its service does not read.
SERVICE_SETTINGS: dict[str, type[ServiceSettings]] = {
    "inference": InferenceSettings,
    "controller": ControllerSettings,
    "generator": GeneratorSettings,
    "extractor": ExtractorSettings,
    "trainer": TrainerSettings,
    "exporter": ExporterSettings,
}

# DRAFTLINE_ variables that draftline reads outside the settings classes. One environment (and one .env) is
# shared by every service and by compose, so each of these must pass every service's start-up check.
# tests/shared/test_settings.py checks that every DRAFTLINE_ name in the repository is a setting or listed here.
OTHER_VARIABLES = frozenset({
    # Read by draftline's own code: the Redis ACL passwords (runtime.redis_acl) and the vLLM CPU environment
    # (services.cli.demo, tools/vllm_cpu.sh).
    "DRAFTLINE_REDIS_CONTROLLER_PASSWORD", "DRAFTLINE_REDIS_WORKER_PASSWORD", "DRAFTLINE_REDIS_EXPORTER_PASSWORD",
    "DRAFTLINE_VLLM_ENV",
    # Read by compose from .env: images, host paths, ids, ports, GPUs and the engines' options (.env.example).
    "DRAFTLINE_IMAGE", "DRAFTLINE_REDIS_IMAGE", "DRAFTLINE_PROMETHEUS_IMAGE", "DRAFTLINE_TORCH_VARIANT",
    "DRAFTLINE_DATA_DIR", "DRAFTLINE_MODEL_DIR_HOST", "DRAFTLINE_UID", "DRAFTLINE_GID",
    "DRAFTLINE_CONTROLLER_BIND", "DRAFTLINE_CONTROLLER_HOST_PORT", "DRAFTLINE_REDIS_BIND", "DRAFTLINE_REDIS_HOST_PORT",
    "DRAFTLINE_GENERATION_GPUS", "DRAFTLINE_INFERENCE_GPUS", "DRAFTLINE_TRAINER_GPUS", "DRAFTLINE_GENERATION_TP",
    "DRAFTLINE_VLLM_EXTRA_ARGS", "DRAFTLINE_VLLM_REASONING_PARSER", "DRAFTLINE_VLLM_TRUST_REMOTE_CODE",
    # Read by tools/docker-setup.sh, which builds the images.
    "DRAFTLINE_TAG", "DRAFTLINE_BASE_TAG", "DRAFTLINE_CA_BUNDLE", "DRAFTLINE_DOCKERD_LOG", "DRAFTLINE_TORCH_WHEELS",
    "DRAFTLINE_WHEEL_PORT",
    # Read by the test suite and the bench scripts, which start services in their own environment.
    "DRAFTLINE_REQUIRE_GPU", "DRAFTLINE_TEST_CACHE", "DRAFTLINE_TEST_BRIDGE",
})
CHECKED_PREFIX = "DRAFTLINE_"

S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], **overrides: object) -> S:
    """Build ``cls`` from the environment; turn validation errors into one readable SettingsError. An unknown
    ``DRAFTLINE_`` variable in the environment or the ``.env`` file raises UnknownSetting."""
    check_unknown_variables(os.environ, "the environment")
    # pydantic-settings' own reader, so the check sees the same .env files, encoding and names the settings do.
    env_file = {"env_file": overrides["_env_file"]} if "_env_file" in overrides else {}
    check_unknown_variables(DotEnvSettingsSource(cls, **env_file).env_vars, "the .env file")
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(part) for part in err["loc"])
            problems.append(f"{env_name(cls, field)}: {err['msg']}")
        raise SettingsError(f"{cls.__name__}: " + "; ".join(problems)) from None


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable that sets ``field`` of ``cls``."""
    info = cls.model_fields.get(field)
    if info is not None and isinstance(info.validation_alias, str):
        return info.validation_alias
    return (cls.model_config.get("env_prefix") or "") + field.upper()


def settings_variables(cls: type[BaseSettings]) -> set[str]:
    """Every environment variable ``cls`` reads."""
    return {env_name(cls, field) for field in cls.model_fields}


def known_variables() -> frozenset[str]:
    """Every DRAFTLINE_ variable draftline reads: each settings class's, and OTHER_VARIABLES."""
    classes = [value for value in globals().values()
               if isinstance(value, type) and issubclass(value, BaseSettings) and value.__module__ == __name__]
    return OTHER_VARIABLES.union(*(settings_variables(cls) for cls in classes))


def check_unknown_variables(names: Iterable[str], source: str) -> None:
    """Raise UnknownSetting naming each DRAFTLINE_ variable in ``names`` that draftline does not read."""
    known = known_variables()
    # pydantic-settings matches names regardless of case, so the check does too.
    unknown = sorted({name.upper() for name in names if name.upper().startswith(CHECKED_PREFIX)} - known)
    if not unknown:
        return
    problems = []
    for name in unknown:
        nearest = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {nearest[0]}?" if nearest else "no known name is close"
        problems.append(f"{name} in {source} is read by no draftline component ({hint})")
    raise UnknownSetting("; ".join(problems) + "; correct or remove it")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,  # the CLI configures logging first; a service's own level must still apply
    )
    # One line per HTTP request drowns the progress a worker reports; keep only their warnings.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
