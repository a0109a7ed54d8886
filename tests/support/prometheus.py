"""A real Prometheus for tests: Debian's ``prometheus`` binary on a free loopback port, its data in a
directory the test owns, queried through its HTTP API.

The configuration is the shipped ``prometheus/prometheus.yml`` adapted to the test (``adapt_config``):
only the targets and the intervals change, so what the test scrapes is what the stack scrapes.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx
import yaml

from tests.support.polling import wait_until
from tests.support.processes import free_port

if TYPE_CHECKING:
    from typing import Self  # annotations only: Python 3.10 lacks it at runtime

T = TypeVar("T")


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its API answered with an error."""


def prometheus_binary() -> str | None:
    """The server binary (Debian package ``prometheus``), or None where it is not installed."""
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").is_file() else None)


def adapt_config(shipped: Path, targets: Mapping[str, str | None], rule_files: list[str],
                 interval: str = "1s") -> dict:
    """The shipped configuration with every job's targets replaced by the test's address for that job.

    The shipped jobs read their targets from the compose layout's files (file_sd_configs); here each job
    scrapes the test's address instead, or nothing where the test runs no such server (None: vLLM, SGLang).
    A job in the shipped file without an entry here is an error, so a job added later cannot go
    unscraped in the test without anyone noticing."""
    config = yaml.safe_load(Path(shipped).read_text())
    config["global"] = {**config.get("global", {}), "scrape_interval": interval, "scrape_timeout": interval,
                        "evaluation_interval": interval}
    config["rule_files"] = rule_files
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    if jobs != set(targets):
        raise PrometheusError(f"shipped jobs {sorted(jobs)} differ from the test's targets {sorted(targets)}")
    for job in config["scrape_configs"]:
        job.pop("file_sd_configs", None)
        address = targets[job["job_name"]]
        job["static_configs"] = [{"targets": [address] if address else []}]
    return config


class PrometheusApi:
    """Prometheus' HTTP API at ``url``: a server of the test's own, or one in a container."""

    def __init__(self, url: str) -> None:
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    def api(self, path: str, **params: object) -> dict | list:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {response.status_code} {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def rules(self) -> list[dict]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for(self, check: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
        """Poll ``check`` until it returns a true value (a non-empty result), and return that."""
        return wait_until(check, what, timeout, interval=0.5)


class Prometheus(PrometheusApi):
    """A prometheus server of the test's own, on a free loopback port."""

    def __init__(self, workdir: Path, config: dict, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.config = config
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self, timeout: float = 60.0) -> Self:
        binary = prometheus_binary()
        if binary is None:
            raise PrometheusError("prometheus not installed (Debian package prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

def has_values(result: list[dict]) -> bool:
    """True when a query result holds at least one number (NaN, e.g. a quantile of no requests, is none)."""
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        if any(not math.isnan(float(value)) for _, value in points):
            return True
    return False
