"""Workers on a second host join a running stack through REDIS_URL and a shared filesystem path.

"Host A" is the stack (password-protected Redis, inference server, controller, exporter) started
through LocalStack with no generator or extractor of its own. "Host B" runs ``draftline serve
generator`` and ``draftline serve extractor`` from another working directory, with nothing in their
environment but REDIS_URL (with the password), DRAFTLINE_DATA, the model directory and the inference
URL, and sees host A's data directory through another path: a symlink standing in for an NFS mount.
Host B's workers do every generate and extract job of a run. Workers pointed at an empty directory
(a mount that is missing) refuse with VolumeMismatch and take no job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.demo import demo_prompts_path
from services.cli.stack import LocalStack, StackConfig, resolve_command
from shared.hidden_file import verify_hidden_file
from shared.jobs import GENERATE_QUEUE
from shared.layout import RunPaths
from runtime.queues import queue
from shared.services import SERVICE_COMMANDS
from runtime.volume import IDENTITY_FILE, VOLUME_KEY
from tests.support.processes import free_port
from tests.support.workers import successful_jobs

pytestmark = pytest.mark.slow

PASSWORD = "remote-host-pw"
RUN = "remote"
ROWS, HOLDOUT = 10, 2
# The count of jobs each host's worker ran is the evidence here; with one sample per extract job (the
# generator's and the controller's setting) that count is known from the samples alone.
ONE_SAMPLE_PER_EXTRACT_JOB = {"DRAFTLINE_EXTRACT_BATCH": "1"}


class Host:
    """Processes of one "host": its own working directory, and only the environment it is given."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.root.mkdir(parents=True)
        self.env = {"PATH": os.environ["PATH"], "HOME": str(root), "PYTHONUNBUFFERED": "1", **env}
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def serve(self, name: str, **env: str) -> subprocess.Popen:
        log_path = self.root / f"{name}-{len(self.procs)}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(resolve_command(SERVICE_COMMANDS[name]), cwd=self.root, env={**self.env, **env},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log_path))
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return next(path for p, path in self.procs if p is proc).read_text(errors="replace")

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def protected_redis(tmp_path_factory):
    """A redis-server that answers only with the password (``requirepass``), on a free port."""
    port, workdir = free_port(), tmp_path_factory.mktemp("redis-pw")
    with open(workdir / "redis.log", "ab") as log:
        proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    conn = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            conn.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def write_dataset(path: Path) -> None:
    prompts = demo_prompts_path().read_text().splitlines()
    path.write_text("\n".join(prompts[:ROWS]) + "\n")


def wait_until(predicate, what: str, timeout: float, stack: LocalStack):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check_alive()
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s")


def status(stack: LocalStack) -> dict:
    return httpx.get(f"{stack.url('controller')}/runs/{RUN}", timeout=30).json()


def samples_settled(s: dict) -> bool:
    gen, ext = s["stages"]["generate"], s["stages"]["extract"]
    generated = gen["done"] + gen["failed"] + gen["dropped"] == s["expected"]
    return generated and ext["done"] + ext["failed"] + ext["dropped"] == gen["done"]


def every_job_counted(conn: redis.Redis, jobs: int) -> dict[str, int] | None:
    """The live workers' successful job counts once they add up to ``jobs``: a job's samples land before
    its worker settles it in RQ, and a finished sample job leaves no record but that count."""
    counts = successful_jobs(conn)
    return counts if sum(counts.values()) >= jobs else None


@pytest.fixture(scope="module")
def remote_run(tmp_path_factory, protected_redis, tiny_model_dir):
    root = tmp_path_factory.mktemp("hosts")
    export = root / "host-a" / "export"  # host A's NVMe path, exported over NFS
    model = Path(shutil.copytree(tiny_model_dir, export / "models" / "tiny"))  # on the volume, as `make demo` puts it
    dataset = root / "prompts.jsonl"
    write_dataset(dataset)
    mount = root / "host-b-mnt"  # host B's mount point of that export
    mount.symlink_to(export, target_is_directory=True)
    config = StackConfig(data=export, model_dir=model, log_dir=root / "host-a" / "logs", redis_url=protected_redis,
                         replicas={"generator": 0, "extractor": 0, "trainer": 0},
                         env={"DRAFTLINE_DATASET_ROOTS": str(root), **ONE_SAMPLE_PER_EXTRACT_JOB})
    conn = redis.Redis.from_url(protected_redis)
    with LocalStack(config) as stack:
        body = {"dataset": str(dataset), "name": RUN, "evaluate": {"holdout": HOLDOUT, "sets": ["holdout"], "curve_max_steps": 2},
                "generation": {"max_tokens": 16, "min_completion_tokens": 1}}
        response = httpx.post(f"{stack.url('controller')}/runs", json=body, timeout=60)
        assert response.status_code == 201, response.text
        wait_until(lambda: queue(GENERATE_QUEUE, conn).count > 0, "generate jobs queued", 60, stack)
        queued_before = queue(GENERATE_QUEUE, conn).get_job_ids()

        worker_env = {"REDIS_URL": protected_redis, "DRAFTLINE_INFERENCE_URL": stack.url("inference"),
                      "DRAFTLINE_HIDDEN_STATES_URL": stack.url("inference"), **ONE_SAMPLE_PER_EXTRACT_JOB}
        # Host C forgot to mount the share: its "mount point" is an empty local directory.
        unmounted = root / "host-c-mnt"
        unmounted.mkdir()
        host_c = Host(root / "host-c", {**worker_env, "DRAFTLINE_DATA": str(unmounted),
                                        "DRAFTLINE_MODEL_DIR": str(unmounted / "models" / "tiny")})
        host_b = Host(root / "host-b", {**worker_env, "DRAFTLINE_DATA": str(mount),
                                        "DRAFTLINE_MODEL_DIR": str(mount / "models" / "tiny")})
        try:
            refused = [host_c.serve("generator"), host_c.serve("extractor")]
            codes = [proc.wait(120) for proc in refused]
            refused_logs = [host_c.log(proc) for proc in refused]
            queued_after_refusal = queue(GENERATE_QUEUE, conn).get_job_ids()

            joined = [host_b.serve("generator"), host_b.serve("extractor")]
            final = wait_until(lambda: (s := status(stack)) and samples_settled(s) and s, "samples settled", 420, stack)
            jobs = len(queued_before) + final["stages"]["extract"]["done"]  # one extract job per sample
            ran = wait_until(lambda: every_job_counted(conn, jobs), "every job settled in RQ", 60, stack)
            alive = [proc.poll() is None for proc in joined]
            pids = [proc.pid for proc in joined]
        finally:
            host_b.stop()
            host_c.stop()
    return {"status": final, "export": export, "unmounted": unmounted, "codes": codes, "refused_logs": refused_logs,
            "queued_before": queued_before, "queued_after_refusal": queued_after_refusal, "alive": alive,
            "pids": pids, "ran": ran, "volume_id": conn.get(VOLUME_KEY).decode()}


def test_redis_answers_only_with_the_password(protected_redis):
    without = protected_redis.replace(f":{PASSWORD}@", "")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(without).ping()


def test_workers_on_another_host_finish_every_generate_and_extract_job(remote_run):
    s = remote_run["status"]
    assert s["expected"] == ROWS - HOLDOUT
    assert s["stages"]["generate"]["failed"] == s["stages"]["extract"]["failed"] == 0, s["failures"]
    assert s["stages"]["extract"]["done"] == s["stages"]["generate"]["done"] > 0
    assert all(remote_run["alive"]), "a host B worker exited"
    generator_pid, extractor_pid = remote_run["pids"]
    # Host A runs no generator or extractor: host B's two workers ran every job, each job once (RQ's count
    # in each worker's hash; a finished sample job itself is deleted at once).
    ran = {name: count for name, count in remote_run["ran"].items() if count}
    [generator] = [name for name in ran if name.startswith("generator-") and name.endswith(f"-{generator_pid}")]
    [extractor] = [name for name in ran if name.startswith("extractor-") and name.endswith(f"-{extractor_pid}")]
    assert ran == {generator: len(remote_run["queued_before"]), extractor: s["stages"]["extract"]["done"]}


def test_files_written_through_the_mount_are_on_host_a(remote_run):
    paths = RunPaths(remote_run["export"], RUN)
    files = sorted(paths.hidden_dir.rglob("*.safetensors"))
    assert len(files) == remote_run["status"]["stages"]["extract"]["done"]
    for path in files:
        verify_hidden_file(path)
    replies = sorted(paths.root.joinpath("generated").rglob("*.json"))
    assert len(replies) >= remote_run["status"]["stages"]["generate"]["done"]
    identity = json.loads((remote_run["export"] / IDENTITY_FILE).read_text())
    assert identity["volume_id"] == remote_run["volume_id"]


def test_workers_without_the_mount_refuse_and_take_no_job(remote_run):
    assert remote_run["codes"] == [2, 2]
    for log in remote_run["refused_logs"]:
        assert "VolumeMismatch" in log and str(remote_run["unmounted"]) in log, log[-3000:]
        assert remote_run["volume_id"] in log  # names the volume it should have seen
    assert remote_run["queued_after_refusal"] == remote_run["queued_before"]
    assert list(remote_run["unmounted"].iterdir()) == []
