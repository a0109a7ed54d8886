"""The shipped Prometheus and Grafana files use only metrics the exporter publishes, and promtool accepts
the configuration, the rules and the rules' unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.exporter import names
from tests.support.processes import REPO

PROMETHEUS_DIR = REPO / "prometheus"
DASHBOARDS_DIR = REPO / "grafana" / "dashboards"
METRIC = re.compile(r"\b(draftline_[a-z0-9_]+)\b")
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian package prometheus)")


def exported() -> set[str]:
    return {value for key, value in vars(names).items() if key.isupper() and isinstance(value, str) and value.startswith("draftline_")}


def alert_expressions() -> list[str]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    found = []
    for path in sorted(DASHBOARDS_DIR.glob("*.json")):
        dash = json.loads(path.read_text())
        found += [target["expr"] for panel in dash["panels"] for target in panel["targets"]]
        found += [var["definition"] for var in dash.get("templating", {}).get("list", []) if "definition" in var]
    return found


def test_alert_rules_use_only_exported_metrics() -> None:
    used = {m for expr in alert_expressions() for m in METRIC.findall(expr)}
    assert used and used <= exported(), f"unknown metrics in alerts.yml: {sorted(used - exported())}"


def test_dashboards_use_only_exported_metrics() -> None:
    used = {m for expr in dashboard_expressions() for m in METRIC.findall(expr)}
    assert used and used <= exported(), f"unknown metrics in dashboards: {sorted(used - exported())}"


def test_metric_names_follow_prometheus_conventions() -> None:
    counters = {names.STAGE_DONE, names.STAGE_RETRIED}
    for name in exported():
        assert re.fullmatch(r"draftline_[a-z0-9_]+", name), name
        assert name.endswith("_total") == (name in counters), f"{name}: _total is for counters only"


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


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
