"""Preflight: check everything a run needs before it starts, and say exactly what to fix.

Each check yields one ``Check``. A failed check of severity ``error`` refuses the run (``POST /runs``
answers 412) unless it is forced; a failed ``warning`` is reported and the run goes ahead; ``info``
records what was found. The checks: Redis answers; the inference server answers and serves the run's
model (and, when the controller knows ``DRAFTLINE_MODEL_DIR``, the same target by fingerprint); the data
directory takes an atomic write and is persistent (tmpfs or /tmp only with
``DRAFTLINE_ALLOW_EPHEMERAL_DATA``); the run's hidden states, replies, checkpoints and export fit the volume
(``runtime.disk`` and ``runtime.disk_training``'s estimates); a GPU is visible when ``DRAFTLINE_DEVICE=cuda``; and a base drafter checkpoint is on the volume (or is
fetched there from the Hugging Face Hub) and verifies.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import redis

from services.controller.runs.base_checkpoint import fetch_checkpoint, verify_checkpoint
from services.controller.runs.datasets import looks_like_repo_id, resolve_files
from services.controller.runs.json_array import ArrayReader
from shared.fingerprint import model_fingerprint
from shared import eagle3
from shared.atomic import atomic_write_bytes
from runtime.disk import (
    estimate_sample_tokens,
    existing_ancestor,
    format_bytes,
    hidden_bytes_per_token,
    reserve_for,
    target_bytes_per_token,
    volume_usage,
)
from runtime.disk_training import reply_bytes, target_config, training_bytes
from shared.endpoints import parse_endpoints
from shared.errors import DatasetError, DraftlineError, PathOutsideVolume
from shared.layout import RunPaths, resolve_inside
from shared.runspec import RunSpec
from shared.settings import ControllerSettings

log = logging.getLogger(__name__)

FAILED_CHECKS = "failed"  # the key of a report's failed checks (in its dict, and in the API's 412 answer)

ERROR, WARNING, INFO = "error", "warning", "info"
HTTP_TIMEOUT_S = 5.0
EPHEMERAL_FS = {"tmpfs", "ramfs"}
DATASET_SAMPLE_BYTES = 4 << 20  # a JSONL file's row count is extrapolated from its first 4 MiB


@dataclass(frozen=True)
class Check:
    """One finding. ``severity`` says what a failure means: error refuses the run, warning only reports."""

    name: str
    ok: bool
    severity: str
    message: str
    fix: str = ""


@dataclass
class PreflightReport:
    checks: list[Check]
    forced: bool = False
    base_checkpoint: str | None = None  # the verified base checkpoint, relative to the volume
    bytes_per_token: float | None = None  # the hidden-state estimate for the served target

    @property
    def errors(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and c.severity == ERROR]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and c.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def allowed(self) -> bool:
        return self.ok or self.forced

    def to_dict(self) -> dict:
        return {"ok": self.ok, "allowed": self.allowed, "forced": self.forced,
                "checks": [asdict(c) for c in self.checks], FAILED_CHECKS: [asdict(c) for c in self.errors],
                "warnings": [asdict(c) for c in self.warnings], "base_checkpoint": self.base_checkpoint}


@dataclass
class Facts:
    """What one check learns that a later one uses."""

    card: dict | None = None  # the served model's entry in /v1/models
    bytes_per_token: float | None = None


def run_preflight(settings: ControllerSettings, *, spec: RunSpec | None = None, force: bool = False) -> PreflightReport:
    """Every check, in order; never raises for a failing check (each failure is a Check)."""
    facts = Facts()
    checks = [check_redis(settings), check_inference(settings, spec, facts), check_fingerprint(settings, facts),
              check_layer_ids(settings, spec, facts), check_writable(settings.data), check_persistent(settings), check_disk(settings, spec, facts),
              check_gpu(settings)]
    report = PreflightReport(checks, forced=force, bytes_per_token=facts.bytes_per_token)
    if spec is not None and spec.train.base_checkpoint:
        check, report.base_checkpoint = check_base_checkpoint(settings, spec.train.base_checkpoint, facts)
        checks.append(check)
    for c in report.errors + report.warnings:
        log.warning("preflight %s: %s: %s", c.severity, c.name, c.message)
    return report


# ---- redis -------------------------------------------------------------------------------------


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def check_redis(settings: ControllerSettings) -> Check:
    conn = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        conn.ping()
    except redis.RedisError as exc:
        return Check("redis", False, ERROR, f"Redis at {redacted(settings.redis_url)} does not answer "
                     f"({type(exc).__name__}: {exc})",
                     "start Redis (`docker compose up -d redis`) or set REDIS_URL to a running server")
    finally:
        conn.close()
    return Check("redis", True, INFO, f"Redis at {redacted(settings.redis_url)} answers")


# ---- the inference server ------------------------------------------------------------------------


def check_inference(settings: ControllerSettings, spec: RunSpec | None, facts: Facts) -> Check:
    """Every endpoint of ``DRAFTLINE_INFERENCE_URL`` answers and serves the run's model, the same one."""
    want = spec.model if spec is not None and spec.model else None
    roots = parse_endpoints(settings.inference_url)
    first: tuple[str, dict] | None = None  # the first endpoint and its card, which the others must match
    for root in roots:
        found = _served_card(root, want, first)
        if isinstance(found, Check):
            return found
        first = first or (root, found)
    facts.card = first[1]
    where = roots[0] if len(roots) == 1 else f"all {len(roots)} endpoints ({', '.join(roots)})"
    return Check("inference server", True, INFO, f"{where} serve{'s' if len(roots) == 1 else ''} "
                 f"{facts.card['id']!r}")


def _served_card(base: str, want: str | None, first: tuple[str, dict] | None) -> dict | Check:
    """The card of the model ``base`` serves for this run, or the failed check naming ``base``."""
    url = f"{base}/v1/models"
    try:
        response = httpx.get(url, timeout=HTTP_TIMEOUT_S)
        response.raise_for_status()
        cards = [c for c in response.json()["data"] if isinstance(c, dict) and "id" in c]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return Check("inference server", False, ERROR, f"{url} does not answer with its model list "
                     f"({type(exc).__name__}: {exc})",
                     "start the inference server (`docker compose up -d inference`, or vllm/sglang with their "
                     "profile) or set DRAFTLINE_INFERENCE_URL to where it listens")
    served = [str(c["id"]) for c in cards]
    if not served:
        return Check("inference server", False, ERROR, f"{url} lists no model",
                     "start the inference server with the target model loaded")
    if want is not None and want not in served:
        return Check("inference server", False, ERROR, f"{base} serves {served}, the run asks for {want!r}",
                     f"submit the run with model {served[0]!r} (or without a model), or point "
                     f"DRAFTLINE_INFERENCE_URL at a server of {want!r}")
    if first is None:
        return next(c for c in cards if c["id"] == (want or served[0]))
    first_url, first_card = first
    card = next((c for c in cards if c["id"] == first_card["id"]), None)
    fingerprints = {(c.get("draftline") or {}).get("fingerprint") for c in (card or {}, first_card)}
    if card is None or (None not in fingerprints and len(fingerprints) > 1):
        return Check("inference server", False, ERROR, f"{base} does not serve the model {first_url} serves "
                     f"({first_card['id']!r}{', same name, other config' if card else ''}; it serves {served})",
                     "every endpoint of DRAFTLINE_INFERENCE_URL must serve the same target: fix or drop "
                     f"{base}")
    return card


def check_fingerprint(settings: ControllerSettings, facts: Facts) -> Check:
    name = "target fingerprint"
    if settings.model_dir is None:
        return Check(name, True, INFO, "DRAFTLINE_MODEL_DIR is not set for the controller; only the model name "
                     "is checked")
    try:
        local = model_fingerprint(settings.model_dir)
    except (OSError, ValueError) as exc:
        return Check(name, False, ERROR, f"DRAFTLINE_MODEL_DIR={settings.model_dir} has no readable config.json "
                     f"({type(exc).__name__}: {exc})",
                     "point DRAFTLINE_MODEL_DIR at the target's Hugging Face directory (config, weights, tokenizer)")
    if facts.card is None:
        return Check(name, True, INFO, "not compared: the inference server did not answer")
    served = (facts.card.get("draftline") or {}).get("fingerprint")
    if served is None:
        return Check(name, True, INFO, f"{facts.card['id']!r} reports no fingerprint (vLLM or SGLang); the "
                     "extractor checks the built-in server's")
    if served != local:
        return Check(name, False, ERROR, f"the served model {facts.card['id']!r} (config fingerprint "
                     f"{served[:12]}…) is not the target in {settings.model_dir} ({local[:12]}…)",
                     "serve the model in DRAFTLINE_MODEL_DIR, or set DRAFTLINE_MODEL_DIR to the served model's "
                     "directory")
    return Check(name, True, INFO, f"the served model is the target in {settings.model_dir} ({local[:12]}…)")


def check_layer_ids(settings: ControllerSettings, spec: RunSpec | None, facts: Facts) -> Check:
    """The run's ``extraction.layer_ids`` exist in the target, checked now rather than by every extract job
    failing after hours of generation."""
    name = "layer ids"
    wanted = spec.extraction.layer_ids if spec is not None else None
    if wanted is None:
        return Check(name, True, INFO, "the run takes the target's default auxiliary layers")
    num_layers, source = _target_layers(settings, facts)
    if num_layers is None:
        return Check(name, False, WARNING, f"extraction.layer_ids {wanted} not checked: {source}",
                     "set DRAFTLINE_MODEL_DIR for the controller so preflight can read the target's config")
    try:
        eagle3.check_layer_ids(list(wanted), num_layers)
    except ValueError as exc:
        return Check(name, False, ERROR, f"extraction.layer_ids {wanted}: {exc} ({source})",
                     f"pick three layer ids in 0..{num_layers - 2}, or leave extraction.layer_ids out for the "
                     f"default {eagle3.default_layer_ids(num_layers) if num_layers >= 4 else '(none: too few layers)'}")
    return Check(name, True, INFO, f"extraction.layer_ids {wanted} exist in the {num_layers}-layer target")


def _target_layers(settings: ControllerSettings, facts: Facts) -> tuple[int | None, str]:
    """The target's decoder layer count and where it was read; (None, why) when nothing says."""
    served = (facts.card or {}).get("draftline") or {}
    if isinstance(served.get("num_layers"), int):
        return served["num_layers"], f"the served {facts.card['id']!r} has {served['num_layers']} layers"
    if settings.model_dir is not None:
        try:
            config = json.loads((Path(settings.model_dir) / "config.json").read_text(encoding="utf-8"))
            layers = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
        except (OSError, ValueError, AttributeError) as exc:
            return None, f"DRAFTLINE_MODEL_DIR's config.json is unreadable ({type(exc).__name__}: {exc})"
        if isinstance(layers, int):
            return layers, f"{settings.model_dir}/config.json has {layers} layers"
        return None, f"{settings.model_dir}/config.json names no num_hidden_layers"
    return None, "the generation server does not report its layers and DRAFTLINE_MODEL_DIR is not set"


# ---- the data directory --------------------------------------------------------------------------


def check_writable(data: Path) -> Check:
    """Write, fsync and rename a probe file exactly as every volume write does, then remove it."""
    data = Path(data)
    probe = data / f".preflight-probe-{uuid.uuid4().hex[:8]}"
    content = b"draftline preflight probe\n"
    try:
        data.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(probe, content)
        readable = probe.read_bytes() == content
        probe.unlink()
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "error")
        return Check("data directory writable", False, ERROR, f"cannot write to the data directory {data}: "
                     f"{exc.strerror or exc} ({code})",
                     f"make {data} writable by uid {os.getuid()} and mounted read-write (compose: "
                     "DRAFTLINE_DATA_DIR owned by DRAFTLINE_UID:DRAFTLINE_GID), or point DRAFTLINE_DATA elsewhere")
    if not readable:
        return Check("data directory writable", False, ERROR, f"{data}: a probe file read back differently",
                     "check the storage behind the data directory")
    return Check("data directory writable", True, INFO, f"{data} takes atomic writes (write, fsync, rename)")


def _unescape(field_: str) -> str:
    """/proc/mounts writes spaces and other special characters as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def mount_of(path: Path, mounts: Path = Path("/proc/mounts")) -> tuple[str, str]:
    """``(mount point, file system type)`` of the mount holding ``path``; ("?", "unknown") when unreadable."""
    target = existing_ancestor(path).resolve()
    best = ("?", "unknown")
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = Path(_unescape(parts[1]))
        inside = point == target or point in target.parents
        if inside and len(str(point)) >= len(best[0] if best[0] != "?" else ""):
            best = (str(point), parts[2])  # later lines stack on earlier ones at the same point
    return best


def check_persistent(settings: ControllerSettings) -> Check:
    data = Path(settings.data)
    point, fstype = mount_of(data)
    resolved = existing_ancestor(data).resolve()
    reasons = []
    if fstype in EPHEMERAL_FS:
        reasons.append(f"on {fstype} (mounted at {point})")
    if resolved == Path("/tmp") or Path("/tmp") in resolved.parents:
        reasons.append("under /tmp")
    name = "data directory persistent"
    if reasons:
        message = f"the data directory {data} is {' and '.join(reasons)}: runs, hidden states and drafters are " \
                  "lost at reboot"
        if settings.allow_ephemeral_data:
            return Check(name, False, WARNING, message + " (accepted: DRAFTLINE_ALLOW_EPHEMERAL_DATA=true)",
                         "fine for a demo; for real runs point DRAFTLINE_DATA at a persistent disk")
        return Check(name, False, ERROR, message,
                     "point DRAFTLINE_DATA (compose: DRAFTLINE_DATA_DIR) at a persistent disk; for a throwaway demo "
                     "set DRAFTLINE_ALLOW_EPHEMERAL_DATA=true or force the run")
    if fstype == "overlay":
        return Check(name, False, WARNING, f"the data directory {data} lives in a container's own file system "
                     "(overlay): it is lost with the container",
                     f"mount a volume at {data} (compose mounts DRAFTLINE_DATA_DIR there)")
    return Check(name, True, INFO, f"{data} is on {fstype} (mounted at {point})")


# ---- disk space ----------------------------------------------------------------------------------


def bytes_per_token_of(card: dict | None, model_dir: Path | None, storage: str = "target") -> float | None:
    """Hidden-state bytes per token: from the served model's card, else from the target's config; stored
    as ``storage`` (the run's ``extraction.storage``) says."""
    info = (card or {}).get("draftline") or {}
    if isinstance(info.get("hidden_size"), int):
        return float(hidden_bytes_per_token(info["hidden_size"], info.get("dtype"), storage))
    per_token = target_bytes_per_token(model_dir, storage) if model_dir is not None else None
    return float(per_token) if per_token else None


def dataset_size(spec: RunSpec) -> tuple[int, int] | None:
    """``(rows, prompt bytes)`` of a local dataset after ``limit``; None for a Hub repo or an unreadable one."""
    path = Path(spec.dataset)
    if not path.exists():
        return None
    try:
        files = resolve_files(path, spec.split)
        sizes = [_file_size(f) for f in files]
    except (DatasetError, OSError, ValueError):
        return None  # submission names the problem with the dataset itself
    rows, size = sum(r for r, _ in sizes), sum(b for _, b in sizes)
    if spec.limit is not None and rows > spec.limit:
        size, rows = int(size * spec.limit / rows), spec.limit
    return (rows, size) if rows else None


def _file_size(path: Path) -> tuple[int, int]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        return meta.num_rows, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(DATASET_SAMPLE_BYTES)
    if path.suffix == ".json" and head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
        return _array_rows(head, size), size
    lines = head.count(b"\n") + (0 if head.endswith(b"\n") or not head else 1)
    if size <= len(head) or not lines:
        return lines, size
    return round(size * lines / len(head)), size  # a large file: extrapolate from its first megabytes


def _array_rows(head: bytes, size: int) -> int:
    """Rows of a JSON-array file from its first bytes: its elements, counted where the head holds the whole
    file, else extrapolated from the complete ones by bytes (its lines say nothing: ShareGPT's file has 571,289
    lines for 17,671 conversations)."""
    reader = ArrayReader(io.BytesIO(head), max_record_bytes=len(head) + 1, name="the dataset's head")
    ends = []
    for _ in reader:  # a malformed element is a row too: it fails, named, at submission
        ends.append(reader.offset(reader.pos))
    if size <= len(head):
        return len(ends)
    ends = ends[:-1]  # the head ends inside its last element
    return round(size * len(ends) / ends[-1]) if ends else 1


def projected_samples(spec: RunSpec, rows: int) -> int:
    """Samples a run of ``rows`` dataset rows makes: each row not held out gives generation.replies, each a reply
    file and a hidden-state file of its own."""
    return max(rows - spec.evaluate.holdout, 0) * spec.generation.replies


def check_disk(settings: ControllerSettings, spec: RunSpec | None, facts: Facts) -> Check:
    data = Path(settings.data)
    free, total = volume_usage(data)
    reserve = reserve_for(total, settings.disk_reserve_bytes, settings.disk_reserve_fraction)
    storage = spec.extraction.storage if spec is not None else "target"
    facts.bytes_per_token = bytes_per_token_of(facts.card, settings.model_dir, storage)
    room = f"{format_bytes(free)} free on {data}, {format_bytes(reserve)} kept in reserve"
    if free < reserve:
        return Check("disk space", False, ERROR, f"{room}: less free space than the reserve",
                     "free space on the volume or grow it (or lower DRAFTLINE_DISK_RESERVE_BYTES / "
                     "DRAFTLINE_DISK_RESERVE_FRACTION)")
    size = dataset_size(spec) if spec is not None else None
    if size is None or facts.bytes_per_token is None:
        why = "no run given" if spec is None else (
            "the dataset's size is known only after submission" if size is None else "the target's size is unknown")
        return Check("disk space", True, INFO, f"{room}; no projection ({why}): the supervisor projects as "
                     "samples land")
    rows, prompt_bytes = size
    samples = projected_samples(spec, rows)
    tokens = estimate_sample_tokens(prompt_bytes / rows, spec.generation.max_tokens, spec.extraction.max_length)
    offline = int(samples * tokens * facts.bytes_per_token)
    replies = reply_bytes(samples, 0, 0, prompt_bytes_per_row=prompt_bytes / rows, max_tokens=spec.generation.max_tokens)
    training = training_bytes(RunPaths(data, spec.name), target_config(settings.model_dir), spec.train)
    per_prompt = f" ({spec.generation.replies} replies per prompt)" if spec.generation.replies > 1 else ""
    states = (f"{samples:,} samples{per_prompt} × {tokens:,.0f} tokens × {facts.bytes_per_token:,.0f} bytes, an "
              "upper estimate from max_tokens")
    if spec.online.enabled and spec.online.budget_bytes is not None:
        # An online run holds at most its budget of states whatever the dataset's size.
        hidden = min(offline, spec.online.budget_bytes)
        states = (f"(online: at most its budget of {format_bytes(spec.online.budget_bytes)}, where offline would "
                  f"keep {format_bytes(offline)}: {states})")
    else:
        hidden = offline
        states = f"({states})"
    projected = hidden + replies + training
    estimate = (f"about {format_bytes(projected)}: {format_bytes(hidden)} of hidden states {states}, "
                f"{format_bytes(replies)} of replies and {format_bytes(training)} of checkpoints and export")
    if projected > free - reserve:
        return Check("disk space", False, WARNING, f"the run needs {estimate}; {room}",
                     "free space or grow the volume, or lower generation.max_tokens or limit; otherwise "
                     "extraction pauses when space runs short and resumes by itself when it returns")
    return Check("disk space", True, INFO, f"the run needs {estimate}; {room}")


# ---- GPU -----------------------------------------------------------------------------------------


def visible_gpus() -> tuple[list[str] | None, str]:
    """Names of the GPUs NVML sees (None when NVML's Python package is missing) and why none, if so."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML: {exc}"
    try:
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        return [], f"NVML: {exc}"
    finally:
        pynvml.nvmlShutdown()
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names], ""


def check_gpu(settings: ControllerSettings) -> Check:
    if settings.device != "cuda":
        return Check("gpu", True, INFO, f"DRAFTLINE_DEVICE={settings.device}: no GPU required")
    names, why = visible_gpus()
    if names is None:
        return Check("gpu", False, WARNING, f"DRAFTLINE_DEVICE=cuda, but GPUs cannot be checked: {why}",
                     "install nvidia-ml-py so preflight can see the GPUs")
    if not names:
        return Check("gpu", False, ERROR, f"DRAFTLINE_DEVICE=cuda, but no GPU is visible ({why or 'none found'})",
                     "install the NVIDIA driver (in Docker also the NVIDIA Container Toolkit, with GPUs reserved "
                     "for the service), or set DRAFTLINE_DEVICE=cpu")
    return Check("gpu", True, INFO, f"{len(names)} GPU(s) visible: {', '.join(names)}")


# ---- base checkpoint -----------------------------------------------------------------------------


def check_base_checkpoint(settings: ControllerSettings, value: str, facts: Facts) -> tuple[Check, str | None]:
    """Verify a local checkpoint, or fetch a Hub repo onto the volume and verify it; return its volume path."""
    name = "base checkpoint"
    data = Path(settings.data).resolve()
    try:
        local = resolve_inside(data, value)
        is_dir = local.is_dir()
    except PathOutsideVolume:
        return Check(name, False, ERROR, f"{value!r} is outside the data volume {data}; the trainer reads base "
                     "checkpoints from the volume only",
                     f"copy the checkpoint directory under {data} and name it relative to the volume"), None
    except (ValueError, OSError) as exc:  # a NUL byte, or a name too long for the file system
        return Check(name, False, ERROR, f"{value[:80]!r} is not a usable path: {exc}",
                     "name the checkpoint directory relative to the volume, or give its Hub repo id"), None
    if not is_dir:
        if not looks_like_repo_id(value):
            return Check(name, False, ERROR, f"{value!r}: no directory at {local}, and not a Hugging Face repo id "
                         "(owner/name)", "copy the drafter onto the volume, or give its Hub repo id"), None
        try:
            local = fetch_checkpoint(data, value)
        except DraftlineError as exc:
            return Check(name, False, ERROR, str(exc),
                         "check the repo id (and HF_TOKEN for a private repo), or download the drafter onto the "
                         "volume yourself and name its directory"), None
    try:
        summary = verify_checkpoint(local, facts.card)
    except DraftlineError as exc:
        return Check(name, False, ERROR, f"{value!r} ({local}) does not verify: {exc}",
                     "use an EAGLE-3 drafter exported for this target (config.json + model.safetensors)"), None
    relative = str(local.relative_to(data))
    return Check(name, True, INFO, f"{value!r} verified at {local}: {summary}"), relative


# ---- text and command line -----------------------------------------------------------------------


MARKS = {ERROR: "FAIL", WARNING: "WARN", INFO: "note"}


def format_preflight(report: PreflightReport) -> str:
    """Operator text: one line per check, each failure followed by what to do about it."""
    lines = []
    for c in report.checks:
        mark = "ok  " if c.ok else MARKS[c.severity]
        lines.append(f"  [{mark}] {c.name:<26} {c.message}")
        if not c.ok and c.fix:
            lines.append(f"         {'':<26} fix: {c.fix}")
    if report.ok:
        verdict = "preflight passed" + (f" with {len(report.warnings)} warning(s)" if report.warnings else "")
    elif report.forced:
        verdict = f"preflight failed {len(report.errors)} check(s); forced, so the run may start anyway"
    else:
        verdict = f"preflight failed {len(report.errors)} check(s); fix them or force the run"
    return "\n".join([verdict, *lines])
