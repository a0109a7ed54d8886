"""The whole pipeline as real processes: Redis, inference server, controller, RQ workers, trainer.

Started through LocalStack, i.e. with the same commands docker-compose.yml runs and ``make demo`` uses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.lifecycle import SAMPLE_STAGES, Outcome, RunKeys
from tests.support.acceptance import assert_report_matches, expected_report_of_run
from tests.support.browser import chromium, dump_dom
from tests.support.runs import wait_terminal

pytestmark = pytest.mark.slow

MALFORMED = {5: "{this is not json", 11: json.dumps({"messages": []}), 17: json.dumps({"prompt": 42})}
RUN = "e2e"
DECODING = {"max_new_tokens": 24, "draft_steps": 2}  # the run's evaluation settings


def write_dataset(path: Path, rows: int = 40) -> None:
    good = demo_prompts_path().read_text().splitlines()
    lines = [MALFORMED.get(i, good[i % len(good)]) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, redis_server, tiny_model_dir):
    root = tmp_path_factory.mktemp("e2e")
    data = root / "data"
    dataset = root / "prompts.jsonl"
    write_dataset(dataset)
    config = StackConfig(data=data, model_dir=tiny_model_dir, log_dir=root / "logs", redis_url=redis_server.url,
                         env={"DRAFTLINE_DATASET_ROOTS": str(root)})
    with LocalStack(config) as stack:
        body = {
            "dataset": str(dataset),
            "name": RUN,
            "generation": {"max_tokens": 24, "min_completion_tokens": 4},
            "train": {"epochs": 2, "batch_size": 8, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 128},
            "evaluate": {"holdout": 4, **DECODING, "humaneval_limit": 2, "curve_max_steps": 3},
        }
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        status = wait_terminal(stack, RUN, timeout=420.0)
        # The status page as a browser renders it, while the real run's services still answer.
        page = dump_dom(f"{stack.url('controller')}/status") if chromium() else None
        conn = redis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = {key: conn.type(key) for key in conn.scan_iter(match=f"*{RUN}*") if not key.startswith("rq:")}
    return {"status": status, "data": data, "redis_url": redis_server.url, "page": page, "model_dir": tiny_model_dir,
            "redis_keys": keys}


def test_run_completes_and_names_every_malformed_row(finished_run):
    status = finished_run["status"]
    assert status["state"] == "complete_with_failures", status
    failed = {f["sample_id"]: f for f in status["failures"] if f["kind"] == "error"}
    assert set(MALFORMED) <= set(failed)
    assert all(failed[i]["stage"] == "generate" and failed[i]["error_class"] for i in MALFORMED)
    gen = status["stages"]["generate"]
    assert gen["done"] + gen["failed"] + gen["dropped"] == status["expected"] == 36  # 40 rows, 4 held out


def test_every_redis_key_the_run_left_is_one_the_lifecycle_names_with_its_type(finished_run):
    layout, found = RunKeys(RUN).types(), finished_run["redis_keys"]
    assert {key: kind for key, kind in found.items() if key not in layout or layout[key] != kind} == {}
    run_keys = RunKeys(RUN)
    assert {run_keys.meta, run_keys.failures} | {run_keys.outcome(s, Outcome.DONE) for s in SAMPLE_STAGES} <= set(found)


def test_every_generated_sample_has_one_verified_hidden_state_file(finished_run):
    status, data = finished_run["status"], finished_run["data"]
    paths = RunPaths(data, RUN)
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert len(files) == status["stages"]["extract"]["done"] == status["stages"]["generate"]["done"] > 0
    for path in files:
        assert path.parent.name == "rows_000000-001999"
        verify_hidden_file(path, layer_ids=[1, 3, 4])
    assert temp_files(paths.root) == []


def test_exported_drafter_verifies_and_acceptance_is_measured(finished_run):
    from modeling.export import verify_export

    status, data = finished_run["status"], finished_run["data"]
    export = Path(status["drafter"]["export_path"])
    assert export == RunPaths(data, RUN).export_dir
    verify_export(export)
    report = json.loads(RunPaths(data, RUN).eval_report.read_text())
    assert report["acceptance_length"] == pytest.approx(status["drafter"]["acceptance_length"])
    paths = RunPaths(data, RUN)
    assert_report_matches(report, expected_report_of_run(finished_run["model_dir"], export, paths.eval_prompts,
                                                         **DECODING))


def test_status_command_names_failures_and_matches_the_api(finished_run):
    env = {**os.environ, "REDIS_URL": finished_run["redis_url"], "DRAFTLINE_DATA": str(finished_run["data"])}
    cli = [sys.executable, "-m", "services.cli.main", "status", RUN]
    as_json = json.loads(subprocess.run([*cli, "--json"], env=env, capture_output=True, text=True, check=True).stdout)
    api = finished_run["status"]
    assert as_json["stages"]["generate"]["done"] == api["stages"]["generate"]["done"]
    assert as_json["errors"]["total"] == api["errors"]["total"] >= len(MALFORMED)
    text = subprocess.run(cli, env=env, capture_output=True, text=True, check=True).stdout
    for sample_id in MALFORMED:
        assert str(sample_id) in text


@pytest.mark.needs_package("chromium")
def test_status_page_in_chromium_shows_the_runs_numbers(finished_run):
    page, status = finished_run["page"], finished_run["status"]
    # The page lists every run the Redis server knows; other tests' runs may share this one.
    page = page[page.index(f'id="run-{RUN}"'):]
    page = page[: page.find("<h2", 1)] if "<h2" in page[1:] else page
    for stage in ("generate", "extract", "train", "evaluate"):
        row = re.search(rf"<tr data-stage=\"{stage}\">.*?</tr>", page, re.DOTALL).group(0)
        s = status["stages"][stage]
        assert f"{s['done']} / {s['total']}" in row, (stage, row)
    assert f">{status['errors']['total']}</b>" in page
    assert {int(i) for i in re.findall(r'data-sample="(\d+)"', page)} >= set(MALFORMED)
    assert f"{status['drafter']['acceptance_length']:.2f}" in page


def test_an_fp8_run_goes_through_every_stage_and_trains_on_its_fp8_files(tmp_path, redis_server, tiny_model_dir):
    """The cheapest whole run (8 samples, one epoch, 2 held out) with ``extraction.storage = "fp8"``."""
    from modeling.export import verify_export

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(demo_prompts_path().read_text().splitlines()[:10]) + "\n")
    config = StackConfig(data=tmp_path / "data", model_dir=tiny_model_dir, log_dir=tmp_path / "logs",
                         redis_url=redis_server.url, env={"DRAFTLINE_DATASET_ROOTS": str(tmp_path)})
    with LocalStack(config) as stack:
        body = {
            "dataset": str(dataset), "name": "fp8-e2e",
            "generation": {"max_tokens": 16, "min_completion_tokens": 0},
            "extraction": {"storage": "fp8"},
            "train": {"epochs": 1, "batch_size": 4, "ttt_steps": 2, "draft_vocab_size": 128, "max_length": 128},
            "evaluate": {"holdout": 2, "sets": ["holdout"], "max_new_tokens": 8, "draft_steps": 2, "curve_max_steps": 2},
        }
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        status = wait_terminal(stack, "fp8-e2e", timeout=420.0)
    assert status["state"] == "complete", status
    paths = RunPaths(config.data, "fp8-e2e")
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert len(files) == status["stages"]["extract"]["done"] == 8
    for path in files:
        assert verify_hidden_file(path, layer_ids=[1, 3, 4], dtype="F8_E4M3", hidden_size=64).dtype == "F8_E4M3"
    verify_export(Path(status["drafter"]["export_path"]))
    assert status["drafter"]["acceptance_length"] >= 1.0
