"""The status page for users without Grafana: one server-rendered HTML page that refreshes itself.

Each run gets a progress bar per stage, throughput, ETA, errors with the failed ids, disk, and the GPUs
NVML sees. Every number comes from ``status.run_status``, the same dict ``draftline status --json``
prints, so the page and the command never disagree; a rate or ETA the data cannot support yet reads
"unknown", as in the command's text.
"""

from __future__ import annotations

from html import escape

from runtime.gpu import GpuReading
from runtime.disk import format_bytes
from services.controller.runs.status import online_text, margin_phrase
from shared.lifecycle import Outcome, Stage

REFRESH_S = 5

STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem;color:#222;max-width:70rem}
h1{font-size:1.4rem}h2{font-size:1.15rem;margin-top:2rem}
.state{font-weight:600;padding:.1rem .5rem;border-radius:.3rem;background:#eef}
.complete{background:#dfd}.complete_with_failures,.failed{background:#fdd}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.25rem .75rem;text-align:left}
.bar{width:18rem;height:.9rem;background:#eee;border-radius:.3rem;overflow:hidden}
.fill{height:100%;background:#4a7}.paused{color:#b00;font-weight:600}
"""


def render_page(statuses: list[dict], gpus: list[GpuReading]) -> str:
    runs = "".join(_run(status) for status in statuses) or "<p>No runs yet: start one with <code>draftline run</code>.</p>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH_S}'><title>draftline status</title>"
        f"<style>{STYLE}</style></head><body><h1>draftline</h1>{runs}{_gpus(gpus)}</body></html>"
    )


def _run(status: dict) -> str:
    rows = "".join(_stage(name, status["stages"][name]) for name in Stage)
    errors, disk, drafter = status["errors"], status["disk"], status["drafter"]
    parts = [
        f"<h2 id='run-{escape(status['run'])}'>{escape(status['run'])} "
        f"<span class='state {escape(status['state'])}'>{escape(status['state'])}</span></h2>",
        "<table><tr><th>stage</th><th>progress</th><th>done / total</th><th>%</th><th>samples/s</th><th>ETA</th></tr>",
        rows, "</table>",
        f"<p>errors: <b data-key='errors.total'>{errors['total']}</b> total, {errors['since_resume']} since resume, "
        f"{errors[Outcome.DROPPED]} dropped</p>",
        f"<p>disk: {format_bytes(disk['used_bytes'])} used, <span data-key='disk.free_bytes' "
        f"data-value='{disk['free_bytes']}'>{format_bytes(disk['free_bytes'])}</span> free; this run "
        f"{format_bytes(disk['run_bytes'])}</p>",
    ]
    if disk.get("paused"):
        parts.append(f"<p class='paused'>PAUSED: new prompts held back and extraction waits for disk space: "
                     f"{escape(str(disk['reason']))}</p>")
    for stage, reason in (disk.get("held") or {}).items():
        parts.append(f"<p class='paused' data-held='{escape(stage)}'>PAUSED: {escape(stage)} waits for disk space: "
                     f"{escape(str(reason))}</p>")
    if status.get("online"):
        online = status["online"]
        parts.append(f"<p data-key='online.spool_bytes' data-value='{online['spool_bytes']}'>"
                     f"{escape(online_text(online).strip())}</p>")
    if drafter["export_path"]:
        accept = drafter["acceptance_length"]
        margin = escape(margin_phrase(status["stages"][Stage.EVALUATE])) if accept else ""
        parts.append(f"<p>drafter: <code>{escape(drafter['export_path'])}</code>"
                     + (f", acceptance length <b data-key='acceptance_length'>{accept:.2f}</b>{margin}" if accept else "")
                     + "</p>")
    if status["failures"]:
        items = "".join(f"<li data-sample='{f['sample_id']}'>{escape(f['stage'])} sample {f['sample_id']}: "
                        f"{escape(f['error_class'])} ({escape(f['kind'])}): {escape(f['message'])}</li>"
                        for f in status["failures"])
        parts.append(f"<details open><summary>failed samples</summary><ul>{items}</ul></details>")
    return "".join(parts)


def _stage(name: str, stage: dict) -> str:
    """A row of the stage table; train and evaluate have no rate or ETA, so those cells stay empty."""
    per_sample = "samples_per_second" in stage
    rate = stage.get("samples_per_second")
    rate_text = "" if not per_sample else "unknown" if rate is None else f"{rate:.2f}"
    eta_text = "" if not per_sample else "paused" if stage.get("paused") else _duration(stage["eta_seconds"])
    # A finished stage's window ends at its last settled sample, not now: "over N s", not "the last N s".
    window = f" title='over {stage['rate_window_seconds']:.0f} s'" if rate else ""
    return (
        f"<tr data-stage='{name}'><td>{name}</td>"
        f"<td><div class='bar'><div class='fill' style='width:{min(stage['percent'], 100.0):.1f}%'></div></div></td>"
        f"<td data-key='done'>{stage[Outcome.DONE]} / {stage['total']}</td><td>{stage['percent']:.1f}</td>"
        f"<td data-key='samples_per_second'{window}>{rate_text}</td><td data-key='eta_seconds'>{eta_text}</td></tr>"
    )


def _gpus(gpus: list[GpuReading]) -> str:
    if not gpus:
        return "<h2>GPUs</h2><p data-key='gpus'>0 GPUs visible to NVML on the controller's host</p>"
    rows = "".join(
        f"<tr><td>{g.index}</td><td>{escape(g.name)}</td>"
        f"<td>{'' if g.utilization_ratio is None else f'{100 * g.utilization_ratio:.0f}%'}</td>"
        f"<td>{'' if g.memory_used_bytes is None else format_bytes(g.memory_used_bytes)}"
        f"{'' if g.memory_total_bytes is None else ' / ' + format_bytes(g.memory_total_bytes)}</td>"
        f"<td>{'' if g.temperature_celsius is None else f'{g.temperature_celsius:.0f} °C'}</td></tr>"
        for g in gpus
    )
    return ("<h2>GPUs</h2><table><tr><th>#</th><th>name</th><th>utilization</th><th>memory</th><th>temperature</th></tr>"
            f"{rows}</table>")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
