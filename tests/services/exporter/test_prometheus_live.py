"""A real Prometheus scrapes the real exporter and the real inference server while a small run goes through
the whole pipeline (LocalStack: the commands docker-compose.yml runs). Then, through Prometheus' API:
every dashboard query returns data, every alert rule evaluates without error, and killing the inference
server makes DraftlineInferenceDown fire.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig
from shared import metrics
from tests.services.exporter import dashboards
from tests.support.processes import REPO
from tests.support.prometheus import (
    Prometheus,
    adapt_config,
    has_values,
)
from tests.support.runs import wait_terminal

pytestmark = [
    pytest.mark.slow,
    pytest.mark.needs_package("prometheus"),
]

RUN = "observed"
ONLINE_RUN = "observed-online"  # the same prompts trained online after it: the online panels' series
BUDGET = 400_000  # bytes: the tiny target's files are some 40 KB; a batch of 4 beside 2 held out fits
ROWS = 10
# Grafana makes $__rate_interval at least four scrape intervals; with the test's 1 s scrapes that is 4 s.
# 10 s leaves rates several samples even when a loaded machine delays scrapes.
RATE_INTERVAL = "10s"
# The one alert the test fires on purpose, with its `for:` shortened from the shipped 2m so the test
# does not wait two minutes; its expression, like every other rule, is the shipped one.
FIRED = "DraftlineInferenceDown"
FIRED_FOR = "2s"


def write_dataset(path: Path) -> None:
    prompts = demo_prompts_path().read_text().splitlines()
    path.write_text("\n".join(prompts[:ROWS]) + "\n")


def rules_copy(tmp_path: Path) -> Path:
    """The shipped alerts.yml with only FIRED's `for:` shortened."""
    rules = yaml.safe_load((REPO / "prometheus" / "alerts.yml").read_text())
    found = [rule for group in rules["groups"] for rule in group["rules"] if rule.get("alert") == FIRED]
    assert len(found) == 1, f"{FIRED} not in alerts.yml"
    found[0]["for"] = FIRED_FOR
    path = tmp_path / "alerts.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def observed(tmp_path_factory, redis_server, tiny_model_dir):
    """The run watched by Prometheus, the stack and Prometheus still up for the assertions."""
    root = tmp_path_factory.mktemp("observed")
    dataset = root / "prompts.jsonl"
    write_dataset(dataset)
    # Jobs and runs other tests left in the session's Redis would be picked up by this stack's workers.
    redis.Redis.from_url(redis_server.url).flushall()
    config = StackConfig(data=root / "data", model_dir=tiny_model_dir, log_dir=root / "logs",
                         redis_url=redis_server.url, env={"DRAFTLINE_DATASET_ROOTS": str(root)})
    stack = LocalStack(config)
    address = {name: stack.url(name).removeprefix("http://") for name in ("exporter", "inference")}
    rules = rules_copy(root)
    prom_config = adapt_config(
        REPO / "prometheus" / "prometheus.yml",
        {"draftline-exporter": address["exporter"], "draftline-inference": address["inference"],
         "vllm": None, "sglang": None},
        [str(rules)],
    )
    with Prometheus(root / "prometheus", prom_config) as prom, stack:
        started = time.time()
        body = {
            "dataset": str(dataset), "name": RUN,
            "generation": {"max_tokens": 12, "min_completion_tokens": 1},
            # Two files held out: the trainer's held-out curve reaches its dashboard panel too.
            "train": {"epochs": 2, "batch_size": 4, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 128,
                      "max_length": 96, "validation_files": 2},
            "evaluate": {"holdout": 2, "max_new_tokens": 12, "draft_steps": 2, "sets": ["holdout"],
                         "curve_max_steps": 2},
        }
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        status = wait_terminal(stack, RUN, timeout=240.0)
        online = {**body, "name": ONLINE_RUN, "online": {"enabled": True, "budget_bytes": BUDGET, "vocab_files": 4}}
        response = httpx.post(f"{stack.url('controller')}/runs", json=online, timeout=60)
        assert response.status_code == 201, response.text
        online_status = wait_terminal(stack, ONLINE_RUN, timeout=240.0)
        assert online_status["state"] != "failed", online_status  # named here, not as a metric that never came
        # The run's last numbers reach Prometheus on the next scrape of the exporter.
        for run in (RUN, ONLINE_RUN):
            prom.wait_for(lambda: prom.query(f'{metrics.ACCEPTANCE_LENGTH}{{run="{run}"}}'),
                          "the acceptance length in Prometheus", timeout=30)
        # A range query evaluates at start + k steps; end one step past the newest sample so it is seen.
        yield {"prom": prom, "stack": stack, "status": status, "online": online_status, "start": started,
               "end": time.time() + 2}


def every_dashboard_query() -> list[dashboards.Query]:
    return [query for dash in dashboards.load().values() for query in dashboards.queries(dash)]


def test_the_run_completes_under_observation(observed) -> None:
    assert observed["status"]["state"] in ("complete", "complete_with_failures"), observed["status"]
    targets = {t["labels"]["job"]: t["health"] for t in observed["prom"].targets()}
    assert targets == {"draftline-exporter": "up", "draftline-inference": "up"}


def test_prometheus_holds_the_numbers_the_controller_reports(observed) -> None:
    prom, status = observed["prom"], observed["status"]
    for stage in ("generate", "extract"):
        (series,) = prom.query(f'{metrics.STAGE_DONE}{{run="{RUN}",stage="{stage}"}}')
        assert float(series["value"][1]) == status["stages"][stage]["done"] > 0
    (expected,) = prom.query(f'{metrics.STAGE_EXPECTED}{{run="{RUN}",stage="train"}}')
    assert float(expected["value"][1]) == status["stages"]["train"]["total"] > 0
    (acceptance,) = prom.query(f'{metrics.ACCEPTANCE_LENGTH}{{run="{RUN}"}}')
    assert float(acceptance["value"][1]) == pytest.approx(status["drafter"]["acceptance_length"])


def test_prometheus_scraped_the_online_spool_as_the_controller_reports_it(observed) -> None:
    prom, online = observed["prom"], observed["online"]["online"]
    assert observed["online"]["state"] in ("complete", "complete_with_failures"), observed["online"]
    (scrapes,) = prom.query(f'count_over_time({metrics.ONLINE_SPOOL_BYTES}{{run="{ONLINE_RUN}"}}[5m])')
    assert float(scrapes["value"][1]) >= 2
    (spool,) = prom.query(f'{metrics.ONLINE_SPOOL_BYTES}{{run="{ONLINE_RUN}"}}')
    (budget,) = prom.query(f'{metrics.ONLINE_BUDGET_BYTES}{{run="{ONLINE_RUN}"}}')
    assert float(spool["value"][1]) == online["spool_bytes"] > 0 and float(budget["value"][1]) == BUDGET
    (peak,) = prom.query(f'max_over_time({metrics.ONLINE_SPOOL_BYTES}{{run="{ONLINE_RUN}"}}[5m])')
    assert float(peak["value"][1]) <= online["peak_bytes"]


@pytest.mark.parametrize("query", every_dashboard_query(), ids=lambda q: f"{q.dashboard}/{q.panel}/{q.ref_id}")
def test_every_dashboard_query_returns_data_during_the_run(observed, query: dashboards.Query) -> None:
    expr = dashboards.substitute(query.expr, {"run": f"{RUN}|{ONLINE_RUN}", "__rate_interval": RATE_INTERVAL})
    result = observed["prom"].query_range(expr, observed["start"], observed["end"], step=1)
    assert has_values(result), f"no data for {query}\nsent: {expr}\ngot: {result}"


def test_every_alert_rule_evaluates_without_error(observed) -> None:
    prom = observed["prom"]
    shipped = {rule["alert"] for group in yaml.safe_load((REPO / "prometheus" / "alerts.yml").read_text())["groups"]
               for rule in group["rules"]}

    def evaluated() -> list[dict] | None:
        rules = prom.rules()
        return rules if all(rule["health"] != "unknown" for rule in rules) else None

    rules = prom.wait_for(evaluated, "every rule evaluated once", timeout=30)
    assert {rule["name"] for rule in rules} == shipped
    broken = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert not broken, broken


def test_killing_the_inference_server_fires_inference_down(observed) -> None:
    prom, stack = observed["prom"], observed["stack"]
    assert not [a for a in prom.alerts() if a["labels"]["alertname"] == FIRED]
    stack.kill("inference")

    def firing() -> list[dict]:
        return [a for a in prom.alerts() if a["labels"]["alertname"] == FIRED and a["state"] == "firing"]

    (alert,) = prom.wait_for(firing, f"{FIRED} firing", timeout=60)
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["instance"] == stack.url("inference").removeprefix("http://")
    assert "does not answer scrapes" in alert["annotations"]["summary"]
    # The exporter still answers: only the dead service is reported.
    assert not [a for a in prom.alerts() if a["labels"]["alertname"] == "DraftlineExporterDown"]
