"""The shipped Grafana dashboards, checked without Grafana: fixed uids, one datasource, defined variables,
known metrics, and provisioning paths that match how docker-compose.yml mounts the folders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shared import metrics
from services.inference import metrics as inference_metrics
from tests.services.exporter import dashboards
from tests.services.exporter.dashboards import BUILTIN_VARIABLES, DATASOURCE_UID
from tests.support.processes import REPO

PROVISIONING = REPO / "grafana" / "provisioning"
METRIC = re.compile(r"\b(draftline_[a-z0-9_]+)\b")
# The dashboards the issue asks for, by uid; each file may hold only one.
EXPECTED_UIDS = {
    "draftline-pipeline-overview", "draftline-storage", "draftline-gpus", "draftline-queues",
    "draftline-training", "draftline-evaluation",
}
ALL = dashboards.load()
ids = [path.name for path in ALL]


def known_metrics() -> set[str]:
    """Names the exporter publishes, plus every sample name of the inference server's registry."""
    found = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str) and v.startswith("draftline_")}
    registry = inference_metrics.InferenceMetrics().registry
    for family in registry.collect():
        found.add(family.name)
        if family.type == "histogram":
            found |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
        if family.type == "counter":
            found.add(f"{family.name}_total")
    return found


def test_every_dashboard_the_issue_lists_exists_once_with_a_fixed_uid_and_title() -> None:
    uids = [dash.get("uid") for dash in ALL.values()]
    titles = [dash.get("title") for dash in ALL.values()]
    assert all(uids) and all(titles)
    assert len(set(uids)) == len(uids), uids
    assert len(set(titles)) == len(titles), titles
    assert set(uids) == EXPECTED_UIDS
    # Grafana refuses uids over 40 characters and outside [A-Za-z0-9_-].
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,40}", uid) for uid in uids)


@pytest.mark.parametrize("path", ALL, ids=ids)
def test_every_panel_and_query_variable_uses_the_provisioned_datasource(path: Path) -> None:
    dash = ALL[path]
    for panel in dashboards.panels(dash):
        where = f"{path.name}: panel {panel.get('id')} {panel.get('title')!r}"
        assert panel.get("datasource") == {"type": "prometheus", "uid": DATASOURCE_UID}, where
        for target in panel.get("targets", []):
            assert target.get("datasource", {}).get("uid") == DATASOURCE_UID, where
    for var in dashboards.variables(dash):
        if var.get("type") == "query":
            assert var.get("datasource", {}).get("uid") == DATASOURCE_UID, f"{path.name}: variable {var['name']}"


@pytest.mark.parametrize("path", ALL, ids=ids)
def test_every_variable_used_is_defined_or_a_grafana_builtin(path: Path) -> None:
    dash = ALL[path]
    defined = {var["name"] for var in dashboards.variables(dash)}
    undefined = dashboards.used_variables(dash) - defined - BUILTIN_VARIABLES
    assert not undefined, f"{path.name} uses undefined variables {sorted(undefined)}"


@pytest.mark.parametrize("path", ALL, ids=ids)
def test_run_labelled_series_are_filtered_by_the_run_variable(path: Path) -> None:
    """Where a panel shows a per-run series, the run picker applies to it."""
    per_run = {metrics.STAGE_PROGRESS, metrics.STAGE_EXPECTED, metrics.STAGE_DONE, metrics.STAGE_REMAINING,
               metrics.STAGE_FAILED, metrics.STAGE_RETRIED, metrics.TRAIN_LOSS, metrics.ACCEPTANCE_LENGTH,
               metrics.TRAIN_ACCURACY, metrics.RUN_HIDDEN_BYTES, metrics.RUN_PROJECTED_BYTES, metrics.ACCEPTANCE_CURVE,
               metrics.ACCEPTANCE_OVER_LOOKUP}
    for query in dashboards.queries(ALL[path]):
        for metric in set(METRIC.findall(query.expr)) & per_run:
            assert re.search(rf'{metric}\{{[^}}]*run=~"\$run"', query.expr), str(query)


def test_the_variable_check_catches_an_undefined_variable() -> None:
    dash = {"templating": {"list": [{"name": "run"}]},
            "panels": [{"title": "x ${stage}", "targets": [{"expr": 'a{run=~"$run"}[$__rate_interval] [[queue]]'}]}]}
    assert dashboards.used_variables(dash) - {"run"} - BUILTIN_VARIABLES == {"stage", "queue"}


def test_dashboards_use_only_known_metrics() -> None:
    known = known_metrics()
    for dash in ALL.values():
        used = {m for query in dashboards.queries(dash) for m in METRIC.findall(query.expr)}
        used |= {m for var in dashboards.variables(dash) for m in METRIC.findall(var.get("definition", ""))}
        assert used, dash["title"]
        assert used <= known, f"{dash['title']}: unknown metrics {sorted(used - known)}"


def test_every_panel_but_rows_has_a_query_and_every_query_is_unique_by_ref_id() -> None:
    for path, dash in ALL.items():
        for panel in dashboards.panels(dash):
            if panel["type"] == "row":
                continue
            refs = [t["refId"] for t in panel.get("targets", [])]
            assert refs and len(set(refs)) == len(refs), f"{path.name}: {panel['title']}"


def test_inference_server_metrics_have_a_place() -> None:
    shown = {m for dash in ALL.values() for q in dashboards.queries(dash) for m in METRIC.findall(q.expr)}
    for metric in (metrics.INFERENCE_REQUEST_DURATION + "_bucket", metrics.INFERENCE_GENERATED_TOKENS,
                   metrics.INFERENCE_HIDDEN_STATE_BYTES):
        assert metric in shown, metric


def compose_mounts(service: str) -> dict[str, str]:
    """Container path -> repository path of the service's bind mounts in docker-compose.yml."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = {}
    for volume in compose["services"][service]["volumes"]:
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            mounts[target] = source
    return mounts


def test_the_dashboards_provider_path_is_where_compose_mounts_the_dashboards() -> None:
    mounts = compose_mounts("grafana")
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "draftline.yml").read_text())["providers"]
    for provider in providers:
        path = provider["options"]["path"]
        assert mounts.get(path) == "./grafana/dashboards", (path, mounts)
    # The provisioning folder itself is mounted where Grafana reads provisioning.
    assert mounts.get("/etc/grafana/provisioning") == "./grafana/provisioning"
    # The home dashboard compose names is one of the mounted files.
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    home = compose["services"]["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home is not None:
        folder, _, filename = home.rpartition("/")
        assert (REPO / mounts[folder] / filename).is_file(), home


def test_the_datasource_has_the_uid_the_dashboards_name_and_points_at_prometheus() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    (source,) = [d for d in datasources if d["uid"] == DATASOURCE_UID]
    assert source["type"] == "prometheus"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert "prometheus" in compose["services"]
    assert source["url"] == "http://prometheus:9090"
