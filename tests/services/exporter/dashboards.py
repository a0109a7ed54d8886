"""Read the shipped Grafana dashboards: every panel (rows included), every query, template variables."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import REPO

DASHBOARDS_DIR = REPO / "grafana" / "dashboards"
DATASOURCE_UID = "draftline-prometheus"  # grafana/provisioning/datasources/prometheus.yml
# $name, ${name} or ${name:format}, [[name]] or [[name:format]]: the three spellings Grafana expands.
VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")
# Variables Grafana defines itself (https://grafana.com/docs/grafana/latest/dashboards/variables/add-template-variables/#global-variables).
BUILTIN_VARIABLES = {
    "__all", "__dashboard", "__from", "__to", "__interval", "__interval_ms", "__rate_interval",
    "__rate_interval_ms", "__range", "__range_s", "__range_ms", "__org", "__user", "__name",
    "__timezone", "__timeFilter", "timeFilter", "__auto", "__auto_interval",
}


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}: {self.expr}"


def load() -> dict[Path, dict]:
    return {path: json.loads(path.read_text()) for path in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(dash: dict) -> Iterator[dict]:
    """Every panel, including those nested in rows (collapsed rows keep theirs in ``panels``)."""
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def variables(dash: dict) -> list[dict]:
    return dash.get("templating", {}).get("list", [])


def queries(dash: dict) -> list[Query]:
    return [
        Query(dash["title"], panel.get("title", ""), target.get("refId", ""), target["expr"])
        for panel in panels(dash)
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def used_variables(node: object) -> set[str]:
    """Variable names referred to anywhere in a dashboard's strings (queries, titles, legends, links)."""
    if isinstance(node, str):
        return {next(g for g in match.groups() if g) for match in VARIABLE.finditer(node)}
    if isinstance(node, dict):
        return set().union(*(used_variables(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(used_variables(v) for v in node)) if node else set()
    return set()


def substitute(expr: str, values: dict[str, str]) -> str:
    """What Grafana sends for ``expr`` once its variables have the given values."""

    def one(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(one, expr)
