"""The status page shows the numbers ``draftline status --json`` gives, escapes what runs write, refreshes."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from services.controller.api.app import create_app
from services.controller.runs.status import run_status
from runtime.gpu import GpuReader
from runtime.disk import StageHold, set_paused
from shared.lifecycle import Failure, Stage
from shared.settings import ControllerSettings
from tests.services.controller.volume import finish_samples, prompt_rows, submit


def test_the_page_shows_the_status_numbers_and_the_failed_ids(data_dir, redis_conn, redis_url, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, "page", prompt_rows(10, bad=(3,)))
    finish_samples(state, generated=[0, 1, 2, 4, 5], extracted=[0, 1])
    state.mark_failed(Failure("page", "extract", 4, "HiddenStateFileError", "<script>alert(1)</script> truncated"))
    status = run_status(data_dir, redis_conn, "page")
    app = create_app(ControllerSettings(data=data_dir, redis_url=redis_url), redis_conn)
    with TestClient(app) as client:
        response = client.get("/status")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert re.search(r"http-equiv='refresh' content='\d+'", html)
    for stage in ("generate", "extract"):
        row = re.search(rf"<tr data-stage='{stage}'>.*?</tr>", html).group(0)
        s = status["stages"][stage]
        assert f"<td data-key='done'>{s['done']} / {s['total']}</td>" in row
    assert f"<b data-key='errors.total'>{status['errors']['total']}</b>" in html
    assert {int(i) for i in re.findall(r"data-sample='(\d+)'", html)} == {f["sample_id"] for f in status["failures"]}
    assert {3, 4} <= {f["sample_id"] for f in status["failures"]}
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    if not GpuReader().available:
        assert "0 GPUs visible" in html  # no NVML here: said, not an error


def test_a_rate_or_eta_the_data_cannot_support_reads_unknown(data_dir, redis_conn, redis_url, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, "burst", prompt_rows(60))
    for sample_id in range(50):  # one batch landing at once: no rate and no ETA yet
        state.mark_done("generate", sample_id)
    app = create_app(ControllerSettings(data=data_dir, redis_url=redis_url), redis_conn)
    with TestClient(app) as client:
        html = client.get("/status").text
    rows = {stage: re.search(rf"<tr data-stage='{stage}'>.*?</tr>", html).group(0) for stage in ("generate", "extract")}
    assert "<td data-key='samples_per_second'>unknown</td><td data-key='eta_seconds'>unknown</td>" in rows["generate"]
    assert "<td data-key='samples_per_second'>0.00</td><td data-key='eta_seconds'>unknown</td>" in rows["extract"]


def test_a_pause_for_disk_space_reads_paused_and_names_every_held_stage(data_dir, redis_conn, redis_url, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, "held", prompt_rows(60))
    for sample_id in range(10):
        state.mark_done("generate", sample_id)
    set_paused(redis_conn, "held", "9.0 MiB still needed; 1.0 MiB free on /data")
    StageHold(redis_conn, "held", Stage.GENERATE).hold("writing the reply of sample 12 found /data <full>")
    app = create_app(ControllerSettings(data=data_dir, redis_url=redis_url), redis_conn)
    with TestClient(app) as client:
        html = client.get("/status").text
    rows = {stage: re.search(rf"<tr data-stage='{stage}'>.*?</tr>", html).group(0) for stage in ("generate", "extract")}
    assert all("<td data-key='eta_seconds'>paused</td>" in row for row in rows.values())
    assert ("PAUSED: new prompts held back and extraction waits for disk space: 9.0 MiB still needed; 1.0 MiB free on "
            "/data") in html
    assert ("<p class='paused' data-held='generate'>PAUSED: generate waits for disk space: writing the reply of sample "
            "12 found /data &lt;full&gt;</p>") in html


def test_without_runs_the_page_says_how_to_start_one(data_dir, redis_conn, redis_url):
    app = create_app(ControllerSettings(data=data_dir, redis_url=redis_url), redis_conn)
    with TestClient(app) as client:
        html = client.get("/status").text
    assert "No runs yet" in html and "draftline run" in html


def test_the_drafters_line_sets_the_baseline_and_the_margins_interval_beside_its_acceptance(data_dir, redis_conn,
                                                                                            redis_url, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, "done", prompt_rows(4))
    state.set_meta(export_path="/v/runs/done/drafter/export", acceptance_length=1.9)
    app = create_app(ControllerSettings(data=data_dir, redis_url=redis_url), redis_conn)
    with TestClient(app) as client:
        html = client.get("/status").text
    assert "acceptance length <b data-key='acceptance_length'>1.90</b></p>" in html  # no lookup measured: none claimed
    state.set_meta(evaluate_k=3, evaluate_lookup_acceptance=1.39, evaluate_over_lookup=0.51,
                   evaluate_over_lookup_low=0.44, evaluate_over_lookup_high=0.58, evaluate_over_lookup_prompts=252,
                   evaluate_over_lookup_level=0.95)
    with TestClient(app) as client:
        html = client.get("/status").text
    assert ("acceptance length <b data-key='acceptance_length'>1.90</b> at k=3, prompt lookup 1.39: +0.51 "
            "(95% +0.44 to +0.58 over 252 prompts)</p>") in html
