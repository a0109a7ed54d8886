"""A run's progress as one dict (the API's and ``draftline status --json``'s answer) and as operator text.

Everything comes from Redis counters and meta: a status call never walks the run directory, so it
costs the same for ten samples and for a million.

A stage's ``samples_per_second`` averages the samples it settled (done, failed or dropped) over
``rate_window_seconds``, at most the last ``RATE_WINDOW_SECONDS`` (a finished stage: its whole run, from its
first settled sample to its last); ``eta_seconds`` is remaining over
that rate. Both are None ("unknown") rather than a number the data cannot support: the rate until the
stage has been observed for ``RATE_MIN_SPAN_SECONDS``, the ETA also until ``ETA_MIN_SETTLED`` samples
settled in the window (``runtime.runstate.Throughput`` states the rule and its error bound).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path

import redis

from runtime.runstate import (
    FINISHED_META,
    GENERATE_REQUESTS,
    GENERATE_REQUESTS_UNCOUNTED,
    RunState,
    StageCounts,
    known_runs,
    read_finished,
)
from runtime.disk import disk_status, format_bytes, format_disk_pause
from runtime.spool import online_status
from shared import metrics
from shared.errors import RunNotFound
from shared.layout import list_runs
from shared.lifecycle import (
    OUTCOMES,
    SAMPLE_STAGES,
    Failure,
    FailureKind,
    Outcome,
    RunKeys,
    RunPhase,
    Stage,
    StageState,
)
from shared.runspec import RunSpec, cached_spec

FAILURES_SHOWN = 50
FAILURE_FIELDS = ("sample_id", "stage", "error_class", "message", "kind")


# ---- per-stage numbers --------------------------------------------------------------------------


def _percent(part: float, total: float) -> float:
    return round(100.0 * part / total, 1) if total > 0 else 0.0


def sample_stage(state: RunState, stage: Stage, total: int, counts: StageCounts, now: float | None = None) -> dict:
    remaining = max(total - counts.settled, 0)
    throughput = state.throughput(stage, now=now, finished=remaining == 0)
    rate, eta = throughput.per_second, throughput.eta_seconds(remaining)
    return {
        "total": total,
        **asdict(counts),  # done, failed, dropped
        "remaining": remaining,
        "percent": _percent(counts.settled, total),
        "samples_per_second": None if rate is None else round(rate, 3),
        "rate_window_seconds": round(throughput.span_s, 1),
        "eta_seconds": None if eta is None else round(eta),
    }


def overall_eta(stages: list[dict]) -> int | None:
    """The slowest stage's ETA; unknown when any stage's is (a known one is then only a lower bound)."""
    etas = [s["eta_seconds"] for s in stages]
    return None if None in etas else max(etas)


def _float(meta: dict[str, str], key: str) -> float | None:
    try:
        return float(meta[key])
    except (KeyError, ValueError):
        return None


def whole_run_stage(meta: dict[str, str], stage: Stage) -> dict:
    done, total = int(float(meta.get(f"{stage}_done", 0))), int(float(meta.get(f"{stage}_total", 0)))
    state: str = StageState.of(meta.get(f"{stage}_state"))
    if state is StageState.PENDING and stage is Stage.TRAIN and "train_enqueued_at" in meta:
        state = "queued"  # shown only: the train job waits in its queue for a trainer
    return {"total": total, Outcome.DONE: done, "percent": _percent(done, total), "state": state,
            "error": meta.get(f"{stage}_error") or None}  # "ErrorClass: message" of the job that failed


# ---- errors and failures -------------------------------------------------------------------------


def first_failures(conn: redis.Redis, run: str, limit: int = FAILURES_SHOWN) -> list[dict]:
    """The first ``limit`` failures by stage order, then sample id; reads only field names plus ``limit`` values."""
    key = RunKeys(run).failures
    fields = [f.decode() if isinstance(f, bytes) else f for f in conn.hkeys(key)]
    order = {stage: i for i, stage in enumerate(SAMPLE_STAGES)}

    def sort_key(field: str) -> tuple[int, int]:
        stage, _, sample_id = field.partition(":")
        return order.get(stage, len(order)), int(sample_id) if sample_id.isdigit() else -1

    chosen = sorted(fields, key=sort_key)[:limit]
    values = conn.hmget(key, chosen) if chosen else []
    return [{k: getattr(Failure.from_json(v), k) for k in FAILURE_FIELDS} for v in values if v is not None]


def errors_since(conn: redis.Redis, run: str, since: float) -> int:
    """Errors (not drops) recorded after ``since``; scans the failure records, so only for resumed runs."""
    count = 0
    for _, raw in conn.hscan_iter(RunKeys(run).failures, count=1000):
        failure = Failure.from_json(raw)
        count += failure.kind == FailureKind.ERROR and failure.at > since
    return count


def error_summary(conn: redis.Redis, run: str, meta: dict[str, str], gen: StageCounts, ext: StageCounts) -> dict:
    total = gen.failed + ext.failed
    resumed_at = _float(meta, "resumed_at")
    since = total if resumed_at is None else errors_since(conn, run, resumed_at)
    return {"total": total, "since_resume": since, Outcome.DROPPED: gen.dropped + ext.dropped}


# ---- disk ----------------------------------------------------------------------------------------


def disk_usage(data: Path, meta: dict[str, str]) -> dict:
    path = Path(data)
    while not path.exists() and path != path.parent:
        path = path.parent
    usage = shutil.disk_usage(path)
    return {"path": str(data), "used_bytes": usage.used, "free_bytes": usage.free, "total_bytes": usage.total,
            "run_bytes": int(float(meta.get("hidden_bytes", 0)))}


# ---- the whole answer ----------------------------------------------------------------------------


def run_status(data: Path, conn: redis.Redis, run: str, now: float | None = None) -> dict:
    """Status of ``run`` at ``now`` (default: the present); RunNotFound when neither Redis nor the volume knows it."""
    now = time.time() if now is None else now
    state = RunState(conn, data, run)
    meta = state.meta()
    if not meta and not state.paths.spec.is_file():
        raise RunNotFound(f"no run {run!r}")
    finished = read_finished(state.paths) if "expected" not in meta else None
    if finished is not None:  # Redis lost a finished run: its record on the volume has the final numbers
        meta = {**finished.get(FINISHED_META, {}), **meta, "expected": finished["expected"], "state": finished["state"]}
    expected = int(meta.get("expected", 0)) if meta else RunSpec.load(data, run).train_ids
    gen, ext = _counts(state, finished, Stage.GENERATE), _counts(state, finished, Stage.EXTRACT)
    generate = sample_stage(state, Stage.GENERATE, expected, gen, now)
    generate.update(generate_requests(meta, gen, uncounted=finished is not None))
    extract = sample_stage(state, Stage.EXTRACT, max(expected - gen.unverified, 0), ext, now)
    train, evaluate = whole_run_stage(meta, Stage.TRAIN), whole_run_stage(meta, Stage.EVALUATE)
    train["loss"] = _float(meta, "train_loss")
    train["padding"] = _float(meta, "train_epoch_padding")  # share of the epoch's computed positions
    train["validation"] = validation_curve(meta)
    evaluate["acceptance_length"] = _float(meta, "acceptance_length")
    evaluate.update(lookup_margin(meta))
    # vLLM's own figure for the export on the first prompts of the same set, where the trainer has one configured
    evaluate["engine_acceptance_length"] = _float(meta, "evaluate_engine_acceptance")
    evaluate["engine_prompts"] = int(float(meta["evaluate_engine_prompts"])) if meta.get("evaluate_engine_prompts") else None
    evaluate["engine_error"] = meta.get("evaluate_engine_error") or None
    errors = error_summary(conn, run, meta, gen, ext)
    disk = {**disk_usage(data, meta), **disk_status(conn, run)}
    for stage, shown in ((Stage.GENERATE, generate), (Stage.EXTRACT, extract)):
        # Held by a disk pause: no rate can say when it ends, space coming back does.
        shown["paused"] = stage in disk["holds"] and shown["remaining"] > 0
        if shown["paused"]:
            shown["eta_seconds"] = None
    for stage, shown in ((Stage.TRAIN, train), (Stage.EVALUATE, evaluate)):
        shown["paused"] = stage in disk["held"]  # its writer found the volume full and waits for space
    paused = any(shown["paused"] for shown in (generate, extract, train, evaluate))
    online = _online(state, meta)
    if online is not None:
        # Extraction follows the trainer, epoch after epoch: its "done" is the files on the spool, and it has no ETA.
        extract["eta_seconds"] = None
    return {
        "run": run,
        "state": RunPhase.of(meta.get("state")),  # stored at every transition (shared.lifecycle)
        "expected": expected,
        "stages": {Stage.GENERATE: generate, Stage.EXTRACT: extract, Stage.TRAIN: train, Stage.EVALUATE: evaluate},
        "errors": errors,
        "failures": first_failures(conn, run),
        "disk": disk,
        "paused": paused,  # held for disk space: eta_seconds is None until space is back
        "eta_seconds": None if paused else overall_eta([generate] if online else [generate, extract]),
        "online": online,
        "drafter": {"export_path": meta.get("export_path") or None, "acceptance_length": evaluate["acceptance_length"],
                    "warning": meta.get("train_warning") or None},
        "updated_at": now,
    }


def _online(state: RunState, meta: dict[str, str]) -> dict | None:
    """An online run's spool against its budget and its trainer's waits (runtime.spool); None offline."""
    try:
        spec = cached_spec(state.paths.data, state.run)
    except (RunNotFound, OSError, ValueError):
        return None
    if not spec.online.enabled or spec.online.budget_bytes is None:
        return None
    return online_status(state, meta, spec.online.budget_bytes).to_dict()


def lookup_margin(meta: dict[str, str]) -> dict:
    """The headline's k, prompt lookup there, and the drafter's margin over it with its interval over the
    headline set's prompts (None each where the evaluation measured no lookup)."""
    prefix, margin = metrics.META_OVER_LOOKUP, None
    if meta.get(prefix):
        margin = {"difference": _float(meta, prefix), "low": _float(meta, f"{prefix}_low"),
                  "high": _float(meta, f"{prefix}_high"), "prompts": int(float(meta.get(f"{prefix}_prompts") or 0)),
                  "level": _float(meta, f"{prefix}_level")}
    k = _float(meta, metrics.META_EVALUATE_K)
    return {"k": None if k is None else int(k),
            "lookup_acceptance_length": _float(meta, metrics.META_LOOKUP_ACCEPTANCE), "over_lookup": margin}


def validation_curve(meta: dict[str, str]) -> dict[str, float | None]:
    """The held-out one-pass acceptance at the trainer's latest checkpoint, k -> length, in k order; empty unless
    the run holds files out of training (train.validation_files)."""
    prefix = metrics.META_TRAIN_VALIDATION_PREFIX
    ks = sorted(int(field[len(prefix):]) for field in meta if field.startswith(prefix) and field[len(prefix):].isdigit())
    return {str(k): _float(meta, f"{prefix}{k}") for k in ks}


def generate_requests(meta: dict[str, str], counts: StageCounts, uncounted: bool = False) -> dict:
    """The generation's cost: requests the target answered (one per turn of a conversation; a retry of the
    same turn is not another) and their mean per settled sample, None before any settled; both None where
    the count is not the run's whole (``uncounted``: its state was rebuilt from the volume after replies were
    made, or only its finished record is left)."""
    if uncounted or meta.get(GENERATE_REQUESTS_UNCOUNTED):
        return {"requests": None, "requests_per_sample": None}
    requests = int(float(meta.get(GENERATE_REQUESTS, 0) or 0))
    settled = counts.settled
    return {"requests": requests, "requests_per_sample": round(requests / settled, 3) if settled else None}


def _counts(state: RunState, finished: dict | None, stage: Stage) -> StageCounts:
    if finished is not None and isinstance(finished.get(stage), dict):
        return StageCounts(**{outcome: int(finished[stage].get(outcome, 0)) for outcome in OUTCOMES})
    return state.counts(stage)


def list_status(data: Path, conn: redis.Redis) -> list[dict]:
    """Status of every run Redis or the volume knows, by name."""
    return [run_status(data, conn, run) for run in sorted(set(known_runs(conn)) | set(list_runs(data)))]


# ---- text ----------------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def _rate(s: dict) -> str:
    """``5.02 samples/s over 4m55s``, ``0.00 samples/s`` or ``unknown samples/s``."""
    rate = s["samples_per_second"]
    if rate is None:
        return "unknown samples/s"
    window = f" over {_duration(s['rate_window_seconds'])}" if rate else ""
    return f"{rate:.2f} samples/s{window}"


def _sample_line(name: str, s: dict) -> str:
    per_sample = s.get("requests_per_sample")
    cost = f"  {per_sample:.2f} requests/sample" if per_sample is not None else ""
    if "requests" in s and s["requests"] is None:
        cost = "  requests/sample unknown (state read back from the volume)"
    return (f"  {name:<9} {s[Outcome.DONE]:>9,} / {s['total']:<9,} {s['percent']:5.1f}%   failed {s[Outcome.FAILED]:,}  "
            f"dropped {s[Outcome.DROPPED]:,}  {_rate(s)}  ETA {_eta(s)}{cost}")


def _eta(s: dict) -> str:
    return "paused" if s.get("paused") else _duration(s["eta_seconds"])


def _whole_line(name: str, s: dict, extra: str) -> str:
    error = f"\n  {'':<9} {s['error']}" if s["state"] == StageState.FAILED and s["error"] else ""
    waiting = "  (paused: waiting for disk space)" if s.get("paused") else ""
    return (f"  {name:<9} {s[Outcome.DONE]:>9,} / {s['total']:<9,} {s['percent']:5.1f}%   {s['state']}{waiting}{extra}"
            f"{error}")


def _acceptance_text(evaluate: dict) -> str:
    """The evaluator's headline and, where vLLM measured the export too, vLLM's figure beside it."""
    accept, engine = evaluate["acceptance_length"], evaluate.get("engine_acceptance_length")
    if accept is None:
        return ""
    text = f"  acceptance length {accept:.2f}{margin_phrase(evaluate)}"
    if engine is not None:
        text += f" (vLLM {engine:.2f} on its first {evaluate['engine_prompts']} prompts)"
    elif evaluate.get("engine_error"):
        text += f" (vLLM failed: {evaluate['engine_error']})"
    return text


def margin_phrase(evaluate: dict) -> str:
    """`` at k=3, prompt lookup 1.39: +0.52 (95% +0.45 to +0.59 over 252 prompts)``: the baseline the headline
    must beat and the margin's interval over the prompts, or nothing where no lookup was measured."""
    margin, lookup = evaluate.get("over_lookup"), evaluate.get("lookup_acceptance_length")
    if margin is None or lookup is None:
        return ""
    head = f" at k={evaluate['k']}, prompt lookup {lookup:.2f}: {margin['difference']:+.2f}"
    if margin["low"] is None or margin["high"] is None:
        return f"{head} ({margin['prompts']} prompts: too few for an interval)"
    return (f"{head} ({margin['level']:.0%} {margin['low']:+.2f} to {margin['high']:+.2f} "
            f"over {margin['prompts']} prompts)")


def _validation_text(curve: dict[str, float | None]) -> str:
    """The held-out one-pass acceptance at its smallest, headline-like and largest k: enough to see it move."""
    shown = [k for k in curve if curve[k] is not None]
    if not shown:
        return ""
    picks = sorted({shown[0], *(k for k in shown if k == "3"), shown[-1]}, key=int)
    return "  held-out " + " ".join(f"k={k} {curve[k]:.2f}" for k in picks)


BOTTLENECK = {"extraction": "extraction is the bottleneck", "training": "training is the bottleneck",
              "unknown": "no bottleneck measured yet"}


WINDOW_LIMIT = {"budget": "the budget", "rates": "the measured rates", "end": "the end of training",
                "unmeasured": "no file size yet"}


def online_text(online: dict) -> str:
    """An online run's spool against its budget, its epoch, and which side waits on the other."""
    fraction = online["train_wait_fraction"]
    epoch = "not training yet" if online["epoch"] is None else (
        f"epoch {online['epoch']}: {online['epoch_trained']:,} of {online['epoch_samples']:,} samples trained")
    waits = ("" if fraction is None else f"; the trainer waited {100 * fraction:.0f}% of its time for files")
    head = f"; waiting for sample {online['waiting_for']}" if online.get("waiting_for") is not None else ""
    evicted = f", {online['evicted']:,} unread to make room" if online.get("evicted") else ""
    share = online.get("extract_blocked_fraction")
    blocked = "" if share is None else f"{100 * share:.0f}% of their time, "
    window = ("" if not online.get("window_limit") else
              f"; window {online['window_files']:,} files, {online['window_steps']:,} steps ahead, "
              f"{format_bytes(online['window_bytes'])} (bounded by {WINDOW_LIMIT[online['window_limit']]})")
    return (f"  online    spool {format_bytes(online['spool_bytes'])} of its {format_bytes(online['budget_bytes'])} "
            f"budget ({online['spool_files']:,} files, peak {format_bytes(online['peak_bytes'])}, "
            f"{online['released']:,} deleted after their steps{evicted}); {epoch}{waits}, extractions blocked "
            f"{blocked}{online['extract_blocked_s']:,.0f}s on the budget ({BOTTLENECK[online['bottleneck']]}){window}"
            f"{head}")


def format_status(status: dict) -> str:
    """Operator text: what is done, what failed and why, how fast, how long, how much disk."""
    stages, errors, disk = status["stages"], status["errors"], status["disk"]
    loss = stages[Stage.TRAIN]["loss"]
    lines = [
        f"run {status['run']}: {status['state']} ({status['expected']:,} samples expected)",
        _sample_line(Stage.GENERATE, stages[Stage.GENERATE]),
        _sample_line(Stage.EXTRACT, stages[Stage.EXTRACT]),
        _whole_line(Stage.TRAIN, stages[Stage.TRAIN], (f"  loss {loss:.4f}" if loss is not None else "")
                    + (f"  padding {100 * padding:.1f}%" if (padding := stages[Stage.TRAIN].get("padding")) is not None else "")
                    + _validation_text(stages[Stage.TRAIN].get("validation") or {})),
        _whole_line(Stage.EVALUATE, stages[Stage.EVALUATE], _acceptance_text(stages[Stage.EVALUATE])),
        f"  errors    {errors['total']:,} total, {errors['since_resume']:,} since resume, "
        f"{errors[Outcome.DROPPED]:,} dropped",
        f"  ETA       {'paused (waiting for disk space)' if status.get('paused') else _duration(status['eta_seconds'])}",
        f"  disk      {format_bytes(disk['used_bytes'])} used, {format_bytes(disk['free_bytes'])} free of "
        f"{format_bytes(disk['total_bytes'])} ({disk['path']}); this run {format_bytes(disk['run_bytes'])}",
    ]
    if pause := format_disk_pause(disk):
        lines.append(pause)
    if status.get("online"):
        lines.append(online_text(status["online"]))
    if status["drafter"]["export_path"]:
        lines.append(f"  drafter   {status['drafter']['export_path']}")
    if status["drafter"].get("warning"):
        lines.append(f"  warning   {status['drafter']['warning']}")
    if status["failures"]:
        lines.append(f"  failures (first {len(status['failures'])}):")
        lines += [f"    {f['stage']:<8} sample {f['sample_id']:<8} {f['kind']:<7} {f['error_class']}: {f['message']}"
                  for f in status["failures"]]
    return "\n".join(lines)
