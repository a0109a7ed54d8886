"""The whole stack in real containers, used as the README tells a user to: runs submitted from the command
line through the controller's published port, replicas scaled, containers killed and restarted while a
run works, the stack taken down and brought up again, Prometheus scraping it.

The tests share one stack (tests/containers/conftest.py) and run in this file's order: each one starts
from what the one before left."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.cli.demo import demo_prompts_path
from services.controller.runs import datasets
from shared import metrics
from shared.atomic import temp_files
from shared.errors import RowError
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.manifest import MANIFEST_NAME, read_manifest
from tests.containers.stack import UID, Stack
from tests.services.exporter import dashboards
from tests.support.polling import wait_until
from tests.support.processes import REPO
from tests.support.prometheus import PrometheusApi, has_values

pytestmark = [pytest.mark.containers, pytest.mark.slow]

SERVICES = {"redis", "inference", "controller", "generator", "extractor", "trainer", "exporter", "prometheus"}
TERMINAL = ("complete", "complete_with_failures", "failed")
# A run small enough for two cores; the tiny target's replies only show the plumbing.
RUN_CONFIG = {
    "generation": {"max_tokens": 32, "min_completion_tokens": 1, "temperature": 0.0},
    # Two files held out of training: the trainer's held-out curve reaches Prometheus and its dashboard panel.
    "train": {"epochs": 1, "batch_size": 8, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 256, "save_every": 50,
              "validation_files": 2},
    "evaluate": {"holdout": 4, "max_new_tokens": 16, "draft_steps": 2, "humaneval_limit": 2, "curve_max_steps": 2},
}
HOLDOUT = RUN_CONFIG["evaluate"]["holdout"]
LAYER_IDS = [1, 3, 4]  # the tiny target's three auxiliary layers and its last (8 layers)
SCALE = {"generator": 3, "extractor": 2}
FAULT_ROWS = 240
INFERENCE_STOPPED_S = 30.0
REDIS_BACK_S = 60.0
RUN_TIMEOUT_S = 600.0
# Grafana makes $__rate_interval four scrape intervals (prometheus.yml scrapes every 15 s).
RATE_INTERVAL = "60s"
# Series this machine cannot make: it has no GPU for NVML to read.
NO_GPU_METRICS = ("draftline_gpu_",)


# ---- how a user reaches the stack ---------------------------------------------------------------------
def api(stack: Stack, path: str) -> dict | list:
    response = httpx.get(f"{stack.controller_url}{path}", headers={"Authorization": f"Bearer {stack.token}"},
                         timeout=30)
    response.raise_for_status()
    return response.json()


def api_through_redis_restart(stack: Stack, path: str) -> dict | list:
    """``api`` while Redis may be restarting. Until Redis has loaded its append-only file the controller
    answers 503 "redis unavailable: Redis is loading the dataset in memory" (seen on 2 of 12 restarts
    mid-run, for under 0.3 s); that answer is waited out for REDIS_BACK_S, any other error fails at once."""
    def answer() -> dict | list | None:
        try:
            return api(stack, path)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 503 and "redis unavailable" in exc.response.text:
                return None
            raise
    return wait_until(answer, f"{path} answered again after Redis restarted", REDIS_BACK_S, interval=0.5)


def place_dataset(stack: Stack, name: str, rows: list[str]) -> str:
    """`cp prompts.jsonl <data>/datasets/`: the file on the host, its path in the containers returned."""
    folder = stack.data / "datasets"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(row + "\n" for row in rows))
    return f"/data/datasets/{name}"


def submit(stack: Stack, run: str, dataset: str, *, limit: int | None = None, online: int | None = None,
           train: dict | None = None) -> str:
    """`draftline run --controller URL …` on the host, with DRAFTLINE_API_TOKEN set; its output. ``online``: the
    run trains online within that many bytes of hidden states; ``train``: settings over RUN_CONFIG's."""
    config = stack.root / "run-config.json"
    config.write_text(json.dumps({**RUN_CONFIG, "train": {**RUN_CONFIG["train"], **(train or {})}}))
    argv = [str(Path(sys.executable).parent / "draftline"), "run", "--controller", stack.controller_url,
            "--dataset", dataset, "--name", run, "--run-config", str(config)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    if online is not None:
        argv += ["--online-budget", str(online)]
    env = {"PATH": "/usr/bin:/bin", "DRAFTLINE_API_TOKEN": stack.token, "HOME": str(stack.root)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=stack.root)
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_done(stack: Stack, run: str, timeout: float = RUN_TIMEOUT_S) -> dict:
    return wait_until(lambda: (status := api(stack, f"/runs/{run}"))["state"] in TERMINAL and status,
                      f"run {run} to end", timeout, interval=2.0, detail=lambda: api(stack, f"/runs/{run}")["stages"])


def demo_rows() -> list[str]:
    return demo_prompts_path().read_text().splitlines()


def worker_names(stack: Stack, service: str, index: int) -> tuple[str, ...]:
    """The RQ worker names of one replica (one, unless its worker restarted within a TTL), as its own health
    check reports them: "generator on <host>: generator-<host>-7 registered"."""
    out = stack.exec(service, "draftline", "worker-health", service, index=index)
    return tuple(out.split(": ", 1)[1].strip().removesuffix(" registered").split(", "))


def jobs_done(stack: Stack, workers: tuple[str, ...]) -> int:
    counts = [stack.exec("redis", "redis-cli", "--no-auth-warning", "HGET", f"rq:worker:{worker}",
                         "successful_job_count") for worker in workers]
    return sum(int(count.strip() or 0) for count in counts)


def files_of(paths: RunPaths) -> tuple[set[int], set[int]]:
    """The sample ids with a generated reply and with a hidden-state file on the volume."""
    generated = [int(p.stem) for p in paths.generated_dir.rglob("*.json")]
    hidden = [int(p.stem) for p in paths.hidden_dir.rglob("*.safetensors")]
    assert len(generated) == len(set(generated)) and len(hidden) == len(set(hidden))
    return set(generated), set(hidden)


def verify_hidden_files(paths: RunPaths) -> None:
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    manifests: dict = {}
    for shard in {p.parent for p in files}:
        manifests.update(read_manifest(shard / MANIFEST_NAME))
    for path in files:
        verify_hidden_file(path, layer_ids=LAYER_IDS, sha256=manifests[int(path.stem)].sha256)


def stage_numbers(status: dict) -> dict:
    return {name: {k: stage.get(k) for k in ("done", "failed", "dropped", "total")}
            for name, stage in status["stages"].items()}


# ---- the tests, in order --------------------------------------------------------------------------------
def test_every_service_turns_healthy_and_the_controller_answers_on_loopback(stack: Stack) -> None:
    running = {c["Service"] for c in stack.containers()}
    assert running == SERVICES, running ^ SERVICES
    assert not stack.unhealthy()
    assert httpx.get(f"{stack.controller_url}/health", timeout=10).json()["status"] == "ok"
    internal = subprocess.run(["docker", "network", "inspect", "-f", "{{.Internal}}", f"{stack.name}_default"],
                              capture_output=True, text=True, check=True).stdout.strip()
    assert internal == "true"


def test_a_run_submitted_from_the_command_line_completes(stack: Stack) -> None:
    out = submit(stack, "first", place_dataset(stack, "prompts.jsonl", demo_rows()), limit=40)
    assert "run first: 40 rows read" in out
    status = wait_done(stack, "first")
    assert status["state"] == "complete", status
    expected = 40 - HOLDOUT
    paths = RunPaths(stack.data, "first")
    generated, hidden = files_of(paths)
    assert generated == hidden == set(range(expected))
    verify_hidden_files(paths)
    # Written by the containers' user, not root.
    owners = {p.stat().st_uid for p in paths.root.rglob("*")}
    assert owners == {UID}, owners
    export = paths.export_dir
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
    report = json.loads(paths.eval_report.read_text())
    assert report["sets"] and all(one["greedy_check"]["matched"] == one["greedy_check"]["checked"]
                                  for one in report["sets"].values())
    # `draftline status` in a container, the API and the status page tell the same numbers.
    cli = json.loads(stack.exec("controller", "draftline", "status", "first", "--json"))
    assert stage_numbers(cli) == stage_numbers(status)
    for stage in ("generate", "extract"):
        assert cli["stages"][stage]["done"] == expected and cli["stages"][stage]["failed"] == 0
    assert cli["drafter"]["export_path"] == "/data/runs/first/drafter/export"
    assert cli["drafter"]["acceptance_length"] == pytest.approx(status["drafter"]["acceptance_length"])
    text = stack.exec("controller", "draftline", "status", "first")
    assert text.startswith("run first: complete")
    page = httpx.get(f"{stack.controller_url}/status", timeout=30).text
    for stage in ("generate", "extract"):
        assert f"<tr data-stage='{stage}'><td>{stage}</td>" in page
    assert page.count(f"<td data-key='done'>{expected} / {expected}</td>") >= 2


def scale_up(stack: Stack) -> None:
    """`docker compose up -d --scale <service>=N` for each of SCALE, every replica healthy."""
    stack.run("up", "-d", *(f"--scale={service}={n}" for service, n in SCALE.items()))
    stack.wait_healthy()


def test_scaled_replicas_each_register_and_take_jobs(stack: Stack) -> None:
    scale_up(stack)
    workers = {(service, i): worker_names(stack, service, i) for service, n in SCALE.items() for i in range(1, n + 1)}
    assert len({name for names in workers.values() for name in names}) == sum(SCALE.values())
    before = {key: jobs_done(stack, name) for key, name in workers.items()}
    submit(stack, "scaled", place_dataset(stack, "scaled.jsonl", demo_rows()), limit=60)
    status = wait_done(stack, "scaled")
    assert status["state"] == "complete", status
    took = {f"{service}-{i}": jobs_done(stack, name) - before[(service, i)] for (service, i), name in workers.items()}
    assert all(count > 0 for count in took.values()), took


def fault_rows() -> list[str]:
    """FAULT_ROWS prompts (the shipped ones, over again: rows without ids may repeat) and one malformed row
    in the middle."""
    rows = [demo_rows()[i % len(demo_rows())] for i in range(FAULT_ROWS)]
    rows.insert(FAULT_ROWS // 2, '{"messages": "not a list of turns"}')
    return rows


def test_faults_while_a_run_works_lose_nothing(stack: Stack) -> None:
    scale_up(stack)  # a replica of each kind survives the one killed (a no-op after the scaling test)
    submit(stack, "faults", place_dataset(stack, "faults.jsonl", fault_rows()))
    landed: list[tuple[str, dict]] = []

    def progress() -> dict:
        stages = api_through_redis_restart(stack, "/runs/faults")["stages"]
        return {k: v["done"] for k, v in stages.items() if k in ("generate", "extract")}

    def when(stage: str, at_least: int) -> None:
        wait_until(lambda: progress()[stage] >= at_least, f"{stage} done >= {at_least}", RUN_TIMEOUT_S)

    def fault(name: str, action) -> None:
        landed.append((name, progress()))
        action()

    when("generate", 10)
    fault("kill a generator", lambda: subprocess.run(["docker", "kill", stack.container_names("generator")[0]],
                                                     check=True, capture_output=True))
    when("extract", 10)
    fault("kill an extractor", lambda: subprocess.run(["docker", "kill", stack.container_names("extractor")[0]],
                                                      check=True, capture_output=True))
    fault("restart redis", lambda: stack.run("restart", "redis"))
    moved = progress()["generate"]
    when("generate", moved + 4)
    fault("stop inference", lambda: stack.run("stop", "inference"))
    time.sleep(INFERENCE_STOPPED_S)
    stack.run("start", "inference")

    status = wait_done(stack, "faults")
    total = FAULT_ROWS + 1 - HOLDOUT
    for name, seen in landed:
        assert seen["generate"] < total and seen["extract"] < total, f"{name} landed after the sample stages: {seen}"
    # The malformed row is the one failure, named; every other sample is a verified file.
    failures = json.loads(stack.exec("controller", "draftline", "failures", "faults", "--json"))
    assert len(failures) == 1 and failures[0]["stage"] == "generate", failures
    assert issubclass(getattr(datasets, failures[0]["error_class"]), RowError), failures
    bad = failures[0]["sample_id"]
    assert status["state"] == "complete_with_failures", status
    paths = RunPaths(stack.data, "faults")
    generated, hidden = files_of(paths)
    expected = set(range(status["stages"]["generate"]["total"])) - {bad}
    assert generated == hidden == expected
    assert status["stages"]["generate"]["done"] == status["stages"]["extract"]["done"] == len(expected)
    assert temp_files(paths.root) == []
    verify_hidden_files(paths)
    # The killed replicas stay down (Docker counts `docker kill` as a stop); the rest of the stack is healthy.
    assert not {name: state for name, state in stack.unhealthy().items() if not state.startswith("exited")}


def test_an_online_run_completes_within_a_third_of_its_offline_bytes(stack: Stack) -> None:
    # "first" trained the same 40 prompts offline: its files are what keeping every state takes.
    offline = sum(path.stat().st_size for path in RunPaths(stack.data, "first").hidden_dir.rglob("*.safetensors"))
    # Under a third, and above the 2 held-out files beside the largest batch: batches are grouped by length, and 8
    # of the longest of 34 files come near a third on their own, so the online twin trains batches of 4.
    budget = offline * 3 // 10
    out = submit(stack, "online", "/data/datasets/prompts.jsonl", limit=40, online=budget, train={"batch_size": 4})
    assert "online: hidden states bounded by" in out and f"({budget:,} bytes)" in out
    status = wait_done(stack, "online")
    assert status["state"] == "complete", status
    paths = RunPaths(stack.data, "online")
    plan = json.loads(paths.online_plan.read_text())
    log = [json.loads(line) for line in paths.train_log.read_text().splitlines()]
    assert sorted(i for record in log for i in record["samples"]) == sorted(plan["train_ids"])  # one epoch, each once
    left = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert sorted(int(p.stem) for p in left) == sorted(plan["validation_ids"])
    online = status["online"]
    largest = max(path.stat().st_size for path in RunPaths(stack.data, "first").hidden_dir.rglob("*.safetensors"))
    # Past the budget the trainer lets through one file at most: the one it waits for.
    assert 0 < online["peak_bytes"] <= budget + largest and online["budget_bytes"] == budget < offline / 3
    assert online["spool_bytes"] == sum(p.stat().st_size for p in left) and online["released"] >= len(plan["train_ids"])


# Enough steps on the tiny target for `docker compose stop` to land mid-epoch; no scheduled checkpoint but the last,
# so the one at the stop is the stop's own.
STOP_CONFIG = {"train": {"epochs": 12, "batch_size": 2, "lr": 2e-3, "ttt_steps": 2, "draft_vocab_size": 256,
                         "save_every": 10_000, "validation_files": 2},
               "evaluate": {"holdout": 4, "max_new_tokens": 8, "draft_steps": 2, "sets": ["holdout"],
                            "curve_max_steps": 2}}
STOP_GRACE_S = 300.0  # the trainer's stop_grace_period in docker-compose.yml


def retrain(stack: Stack, source: str, name: str, sections: dict) -> None:
    """`draftline retrain SOURCE --name NAME --run-config FILE --controller URL` on the host."""
    config = stack.root / f"{name}-config.json"
    config.write_text(json.dumps(sections))
    argv = [str(Path(sys.executable).parent / "draftline"), "retrain", source, "--name", name, "--run-config",
            str(config), "--controller", stack.controller_url]
    env = {"PATH": "/usr/bin:/bin", "DRAFTLINE_API_TOKEN": stack.token, "HOME": str(stack.root)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=stack.root)
    assert done.returncode == 0, done.stderr


def train_log(stack: Stack, run: str) -> list[dict]:
    return [json.loads(line) for line in RunPaths(stack.data, run).train_log.read_text().splitlines()]


def test_a_trainer_stopped_mid_epoch_checkpoints_and_its_run_resumes_at_that_step(stack: Stack) -> None:
    retrain(stack, "first", "stopped", STOP_CONFIG)
    wait_until(lambda: (train := api(stack, "/runs/stopped")["stages"]["train"])["total"]
               and train["done"] >= train["total"] // 3, "a third of the steps trained", RUN_TIMEOUT_S, interval=0.5)
    started = time.monotonic()
    stack.run("stop", "trainer", timeout=STOP_GRACE_S + 60)  # SIGTERM; SIGKILL after the grace period
    stopped_in = time.monotonic() - started
    paths = RunPaths(stack.data, "stopped")
    at_stop = train_log(stack, "stopped")
    steps = [record["step"] for record in at_stop]
    state = json.loads((max(paths.checkpoints_dir.glob("step_*")) / "state.json").read_text())
    queued = stack.exec("redis", "redis-cli", "--no-auth-warning", "LRANGE", "rq:queue:draftline-train", "0", "0")
    status = api(stack, "/runs/stopped")
    stack.run("start", "trainer")
    wait_until(lambda: all(c["State"] == "running" and c.get("Health", "") in ("", "healthy")
                           for c in stack.containers() if c["Service"] == "trainer"), "the trainer healthy again", 120)
    assert stopped_in < STOP_GRACE_S / 5, stopped_in  # well inside the grace period: no SIGKILL
    assert steps == list(range(1, len(steps) + 1)) and 0 < steps[-1] < status["stages"]["train"]["total"]
    assert state["position"]["step"] == steps[-1]  # checkpointed at the step it stopped after
    assert queued.strip() == "train_stopped" and status["stages"]["train"]["state"] != "failed"
    assert wait_done(stack, "stopped")["state"] == "complete"

    retrain(stack, "first", "unstopped", STOP_CONFIG)  # the uninterrupted twin: same capture, recipe and seed
    assert wait_done(stack, "unstopped")["state"] == "complete"
    stopped, twin = train_log(stack, "stopped"), train_log(stack, "unstopped")
    assert [r["step"] for r in stopped] == [r["step"] for r in twin]  # no step lost, none twice
    assert [r["samples"] for r in stopped] == [r["samples"] for r in twin]  # the same batches in the same order
    assert [r["loss"] for r in stopped] == pytest.approx([r["loss"] for r in twin], rel=1e-4)  # the same training


def test_prometheus_scrapes_the_stack_and_every_dashboard_query_runs(stack: Stack) -> None:
    prom = PrometheusApi(stack.prometheus_url)
    targets = prom.wait_for(lambda: (found := prom.targets()) and all(t["health"] == "up" for t in found) and found,
                            "every scrape target up", timeout=60)
    assert {t["labels"]["job"] for t in targets} == {"draftline-exporter", "draftline-inference"}
    shipped = {rule["alert"] for group in yaml.safe_load((REPO / "prometheus" / "alerts.yml").read_text())["groups"]
               for rule in group["rules"]}
    rules = prom.wait_for(lambda: (found := prom.rules()) and all(r["health"] != "unknown" for r in found) and found,
                          "every rule evaluated", timeout=60)
    assert {rule["name"] for rule in rules} == shipped
    assert not {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    # The run's last numbers (training, evaluation) reach Prometheus on the exporter's next scrape.
    prom.wait_for(lambda: prom.query(f'{metrics.ACCEPTANCE_LENGTH}{{run="faults"}}'),
                  "the faults run's acceptance length in Prometheus", timeout=60)
    # The online run may train between two 15 s scrapes; its spool's series stays, so two scrapes come.
    prom.wait_for(lambda: (found := prom.query(f'count_over_time({metrics.ONLINE_SPOOL_BYTES}{{run="online"}}[5m])'))
                  and float(found[0]["value"][1]) >= 2, "two scrapes of the online run's spool", timeout=60)
    end = time.time() + 15  # a range query evaluates at start + k steps: one step past the newest sample
    start = end - 1800
    empty = []
    for dash in dashboards.load().values():
        for query in dashboards.queries(dash):
            expr = dashboards.substitute(query.expr, {"run": "faults|online", "__rate_interval": RATE_INTERVAL})
            result = prom.query_range(expr, start, end, step=15)  # raises on a query Prometheus refuses
            if not has_values(result) and not any(metric in expr for metric in NO_GPU_METRICS):
                empty.append(str(query))
    assert not empty, "queries without the run's series:\n" + "\n".join(empty)


def test_down_and_up_keep_the_finished_runs_and_resume_verifies_them(stack: Stack) -> None:
    before = {run: api(stack, f"/runs/{run}") for run in ("first", "scaled", "faults")}
    stack.run("down", "--timeout", "60")
    assert stack.containers(all_states=True) == []
    stack.run("up", "-d")
    stack.wait_healthy()
    for run, status in before.items():
        after = api(stack, f"/runs/{run}")
        assert (after["state"], stage_numbers(after)) == (status["state"], stage_numbers(status)), run
    report = json.loads(stack.exec("controller", "draftline", "resume", "first", "--json"))
    expected = 40 - HOLDOUT
    assert (report["generated"], report["extracted"], report["redone"], report["state"]) == \
        (expected, expected, [], "complete"), report


def test_logs_hold_no_traceback_the_test_did_not_cause(stack: Stack) -> None:
    found = {}
    for service in sorted(SERVICES):
        log = stack.run("logs", "--no-color", service, timeout=120)
        if "Traceback" in log:
            found[service] = log[log.index("Traceback") - 400:][:3000]
    assert not found, found
