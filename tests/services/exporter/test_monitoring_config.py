"""The shipped Prometheus files use only metrics the exporter publishes, every alert the issue asks for
exists with ``for:``, a severity and a summary, and promtool accepts the configuration, the rules and the
rules' unit tests. Metric names follow Prometheus' conventions. (Dashboards: test_dashboards.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shared import metrics
from services.inference import metrics as inference_metrics
from tests.support.processes import REPO

PROMETHEUS_DIR = REPO / "prometheus"
METRIC = re.compile(r"\b(draftline_[a-z0-9_]+)\b")
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.needs_package("prometheus")


def exported() -> set[str]:
    return {value for key, value in vars(metrics).items() if key.isupper() and isinstance(value, str) and value.startswith("draftline_")}


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_use_only_exported_metrics() -> None:
    used = {m for rule in alert_rules() for m in METRIC.findall(rule["expr"])}
    assert used and used <= exported(), f"unknown metrics in alerts.yml: {sorted(used - exported())}"


# The alerts issue 4 asks for, each by the rule that answers it.
ISSUE_ALERTS = {
    "a stage stalled while work remains": "DraftlineStageStalled",
    "error rate above a threshold": "DraftlineStageErrorRateHigh",
    "disk projected to run out before the run ends": "DraftlineRunOutgrowsVolume",
    "inference server down": "DraftlineInferenceDown",
    "no workers on a queue that has work": "DraftlineQueueWithoutWorkers",
    "GPUs idle while work is queued": "DraftlineGpusIdleWhileWorkQueued",
}


def test_every_alert_the_issue_lists_exists() -> None:
    present = {rule["alert"] for rule in alert_rules()}
    missing = {what: name for what, name in ISSUE_ALERTS.items() if name not in present}
    assert not missing, missing


def test_every_alert_waits_has_a_severity_and_a_summary() -> None:
    for rule in alert_rules():
        assert rule.get("for"), f"{rule['alert']}: no for:, one bad scrape would page"
        assert rule.get("labels", {}).get("severity") in {"warning", "critical"}, rule["alert"]
        assert rule.get("annotations", {}).get("summary"), rule["alert"]


def all_metric_names() -> dict[str, str]:
    """Every name the exporter and the inference server publish, with its type."""
    found = {name: "counter" if name.endswith("_total") else "gauge" for name in exported()}
    for family in inference_metrics.InferenceMetrics().registry.collect():
        # prometheus_client strips _total from a counter family's name; its samples carry it.
        found[f"{family.name}_total" if family.type == "counter" else family.name] = family.type
    return found


def test_metric_names_follow_prometheus_conventions() -> None:
    counters = {metrics.STAGE_DONE, metrics.STAGE_RETRIED, metrics.INFERENCE_REQUESTS, metrics.INFERENCE_GENERATED_TOKENS,
                metrics.INFERENCE_HIDDEN_STATE_BYTES, metrics.ONLINE_TRAIN_SECONDS, metrics.ONLINE_TRAIN_WAIT_SECONDS,
                metrics.ONLINE_EXTRACT_BLOCKED_SECONDS, metrics.ONLINE_EXTRACT_SECONDS}
    for name in exported():
        assert name.endswith("_total") == (name in counters), f"{name}: _total is for counters only"
    for name, kind in all_metric_names().items():
        assert re.fullmatch(r"draftline_[a-z0-9_]+", name), name
        assert name.endswith("_total") == (kind == "counter"), f"{name} ({kind}): _total is for counters only"
        # Base units: seconds, bytes, ratios in 0..1 — never milliseconds, kilobytes or percent.
        assert not re.search(r"_(ms|milliseconds|minutes|hours|[kmg]i?b|kilobytes|megabytes|percent)(_|$)", name), name
        if "utilization" in name or "accuracy" in name or "progress" in name:
            assert name.endswith("_ratio"), f"{name}: shares are ratios in 0..1"


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_the_prometheus_configuration() -> None:
    result = run_promtool("check", "config", "prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    result = run_promtool("check", "rules", "prometheus/alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rule_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", "prometheus/tests/alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / "alerts.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - alert: Broken\n        expr: rate(draftline_stage_done_total[5m]\n")
    assert run_promtool("check", "rules", str(broken)).returncode != 0
