"""Training across hosts: two namespaced hosts on this machine, one gloo rank each, brought together by
torchrun's c10d rendezvous. Host A runs the train job (as the trainer's RQ worker runs it) with Redis beside
it; host B runs ``draftline serve trainer`` with ``DRAFTLINE_TRAIN_NODE=join``; the volume is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.trainer.checkpoint import latest_checkpoint
from services.trainer.launch import child_env, join_trainings
from services.trainer.rendezvous import Rendezvous, announce, torchrun_args
from services.trainer.session import trained_from_checkpoint
from services.trainer.train import train_drafter
from shared.errors import SettingsError
from shared.layout import RunPaths
from shared.runspec import RunSpec
from shared.settings import TrainerSettings, load_settings
from tests.support.tiny_runs import write_run
from tests.services.trainer.test_distributed import DDP_SAMPLES, DDP_TRAIN, assert_two_ranks_trained_what_one_did, unequal
from tests.support.netns import Host, NamespacesUnavailable, kill_group, two_hosts, wait_for_line
from tests.support.processes import REPO, free_port

REDIS_PORT = 6390
RDZV_PORT = 29511
TIMEOUT_S = 60  # the rendezvous join and collective timeout the nodes run with
JOB = ("import json, logging, sys; from services.trainer import jobs; "
       "logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
       "print('TRAINED', json.dumps(jobs.train({'run': sys.argv[1]})), flush=True)")


@dataclass
class Cluster:
    a: Host
    b: Host
    data: Path
    logs: Path
    model_dir: Path
    joiner: subprocess.Popen | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://{self.a.addr}:{REDIS_PORT}/0"

    def env(self, host: Host, **settings: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTLINE_") and k != "REDIS_URL"}
        return {**base, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "REDIS_URL": self.redis_url,
                "DRAFTLINE_DATA": str(self.data), "DRAFTLINE_MODEL_DIR": str(self.model_dir), "DRAFTLINE_DEVICE": "cpu",
                "DRAFTLINE_TRAIN_PROCS": "1", "DRAFTLINE_TRAIN_NODE_ADDR": host.addr,
                "DRAFTLINE_TRAIN_TIMEOUT_S": str(TIMEOUT_S), "GLOO_SOCKET_IFNAME": host.ifname, **settings}

    def start_joiner(self) -> subprocess.Popen:
        """Host B's trainer, joining every training host A's jobs announce."""
        log = self.logs / "node-b.log"
        self.joiner = self.b.popen([sys.executable, "-m", "services.cli.main", "serve", "trainer"], log,
                                   self.env(self.b, DRAFTLINE_TRAIN_NODE="join"))
        wait_for_line(log, "waiting for a multi-node training to join", 60, self.joiner)
        return self.joiner

    def job_env(self, endpoint: str | None = None, nodes: int = 2) -> dict[str, str]:
        """Host A's train job as one of ``nodes``, hosting the rendezvous at ``endpoint`` (its own by default)."""
        if nodes == 1:
            return self.env(self.a, DRAFTLINE_TRAIN_NODES="1")
        return self.env(self.a, DRAFTLINE_TRAIN_NODES=str(nodes),
                        DRAFTLINE_TRAIN_RDZV_ENDPOINT=endpoint or f"{self.a.addr}:{RDZV_PORT}")

    def train_job(self, run: str, *, endpoint: str | None = None, nodes: int = 2,
                  timeout_s: float = 300) -> tuple[int, str]:
        """The train job of ``run`` on host A; its exit status and output."""
        done = subprocess.run(self.a.argv([sys.executable, "-c", JOB, run]), env=self.job_env(endpoint, nodes),
                              capture_output=True, text=True, timeout=timeout_s)
        return done.returncode, done.stdout + done.stderr


@pytest.fixture()
def cluster(data_dir, tiny_model_dir, tmp_path) -> Iterator[Cluster]:
    with ExitStack() as stack:
        try:
            a, b = stack.enter_context(two_hosts())
        except NamespacesUnavailable as exc:  # the reason is the failure: these tests never skip
            pytest.fail(f"cannot make two namespaced hosts here: {exc}")
        made = Cluster(a, b, data_dir, tmp_path / "logs", tiny_model_dir)
        redis_log = made.logs / "redis.log"
        redis = a.popen(["redis-server", "--bind", a.addr, "--port", str(REDIS_PORT), "--save", "", "--appendonly",
                         "no", "--protected-mode", "no", "--dir", str(tmp_path)], redis_log, os.environ)
        stack.callback(kill_group, redis)
        stack.callback(lambda: made.joiner is not None and kill_group(made.joiner))
        wait_for_line(redis_log, "Ready to accept connections", 30, redis)
        yield made


@pytest.mark.multinode
def test_two_nodes_of_one_rank_train_what_one_process_trains(cluster, tiny_target, tiny_samples, eval_messages):
    samples = unequal(tiny_samples[:DDP_SAMPLES])
    one = write_run(cluster.data, "one", tiny_target, samples, eval_messages, train={**DDP_TRAIN, "batch_size": 4})
    two = write_run(cluster.data, "two", tiny_target, samples, eval_messages, train={**DDP_TRAIN, "batch_size": 2})
    single = train_drafter(RunSpec.load(cluster.data, "one"), data=cluster.data, model_dir=cluster.model_dir,
                           device="cpu")
    cluster.start_joiner()
    code, output = cluster.train_job("two")
    assert code == 0, output
    assert json.loads(output.split("TRAINED ", 1)[1].splitlines()[0])["steps"] == 2
    double = trained_from_checkpoint(RunSpec.load(cluster.data, "two"), data=cluster.data,
                                     model_dir=cluster.model_dir)
    assert json.loads((two.checkpoint(2) / "state.json").read_text())["world_size"] == 2
    assert_two_ranks_trained_what_one_did(one, two, single, double, samples)
    node_b = (cluster.logs / "node-b.log").read_text()
    assert "run two: joining training two-" in node_b and "finished on this node" in node_b
    assert not (two.root / "train-ranks").exists() or not any((two.root / "train-ranks").iterdir())


# 16 samples: 400 steps of 4, the same steps on any number of processes (so a retry may run on fewer nodes).
LONG_TRAIN = {"epochs": 100, "ttt_steps": 2, "save_every": 5, "global_batch_size": 4}


def train_records(paths: RunPaths) -> list[dict]:
    lines = paths.train_log.read_text().splitlines() if paths.train_log.is_file() else []
    return [json.loads(line) for line in lines]


@pytest.mark.multinode
def test_a_killed_node_fails_the_training_by_name_in_time_and_a_retry_on_the_other_node_completes(cluster, make_run):
    paths = make_run("killed", train=LONG_TRAIN)
    joiner = cluster.start_joiner()
    job_log = cluster.logs / "job-a.log"
    job = cluster.a.popen([sys.executable, "-c", JOB, "killed"], job_log, cluster.job_env())
    try:
        wait_until_trained_steps(paths, 6, job, job_log)  # past the first checkpoint (step 5)
        kill_group(joiner)  # host B's trainer, its torchrun and its rank, all at once
        started = time.monotonic()
        code = job.wait(timeout=TIMEOUT_S + 60)  # no hang: the lost peer fails host A's rank
        failed_after = time.monotonic() - started
    finally:
        kill_group(job)
    output = job_log.read_text()
    assert code != 0 and "TrainingProcessFailed: " in output and "TRAINED" not in output, output[-3000:]
    assert failed_after < TIMEOUT_S + 30
    checkpoint = latest_checkpoint(paths.checkpoints_dir)
    assert checkpoint is not None and json.loads((checkpoint / "state.json").read_text())["world_size"] == 2
    resumed_at = int(checkpoint.name.removeprefix("step_"))
    assert 5 <= resumed_at < 400

    # Host B stays down: the retry trains on host A alone, from the checkpoint two nodes wrote.
    code, output = cluster.train_job("killed", nodes=1, timeout_s=600)
    assert code == 0, output[-3000:]
    assert f"resuming from step {resumed_at} of 400 on 1 training processes (the checkpoint's: 2)" in output
    assert json.loads(output.split("TRAINED ", 1)[1].splitlines()[0])["steps"] == 400
    assert [r["step"] for r in train_records(paths)] == list(range(1, 401))  # each step logged once


CUT_TIMEOUT_S = 15  # the collective timeout of the cut-link test: the job must fail by it, so keep it short


@pytest.mark.multinode
def test_a_cut_link_fails_the_training_by_its_timeout_not_a_hang(cluster, make_run):
    """A pulled cable tells no socket (no FIN, no reset), unlike a killed node: only the timeout ends the wait."""
    paths = make_run("cut", train=LONG_TRAIN)
    cluster.start_joiner()
    job_log = cluster.logs / "job-cut.log"
    job = cluster.a.popen([sys.executable, "-c", JOB, "cut"], job_log,
                          {**cluster.job_env(), "DRAFTLINE_TRAIN_TIMEOUT_S": str(CUT_TIMEOUT_S)})
    try:
        wait_until_trained_steps(paths, 6, job, job_log)
        subprocess.run(cluster.b.argv(["ip", "link", "set", cluster.b.ifname, "down"]), check=True)
        started = time.monotonic()
        code = job.wait(timeout=CUT_TIMEOUT_S + 120)
        failed_after = time.monotonic() - started
    finally:
        kill_group(job)
    output = job_log.read_text()
    assert code != 0 and "TrainingProcessFailed: " in output and "TRAINED" not in output, output[-3000:]
    # gloo's own timeout, named in the job's error. It words it by where the rank waited: a pending receive says
    # how long it waited; a pair its timeout closed (a buffer broadcast, seen once from a clean clone) says so.
    assert (f"Timed out waiting {CUT_TIMEOUT_S * 1000}ms" in output
            or "Application timeout caused pair closure" in output), output[-3000:]
    assert CUT_TIMEOUT_S * 0.5 <= failed_after < CUT_TIMEOUT_S + 60, (failed_after, output[-3000:])


def wait_until_trained_steps(paths: RunPaths, steps: int, job: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + 180
    while time.monotonic() < end:
        try:
            if len(train_records(paths)) >= steps:
                return
        except ValueError:
            pass  # a line being written
        if job.poll() is not None:
            raise AssertionError(f"the job ended before step {steps}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no step {steps} within 180s:\n{log.read_text()[-3000:]}")


@pytest.mark.multinode
def test_an_endpoint_the_job_host_cannot_listen_on_is_a_clear_error(cluster, make_run):
    make_run("elsewhere", train=DDP_TRAIN)
    code, output = cluster.train_job("elsewhere", endpoint=f"{cluster.b.addr}:{RDZV_PORT}", timeout_s=120)
    assert code != 0
    assert "RendezvousUnreachable" in output and f"DRAFTLINE_TRAIN_RDZV_ENDPOINT={cluster.b.addr}:{RDZV_PORT}" in output
    assert "cannot listen there" in output


def test_several_nodes_need_the_rendezvous_endpoint_named(tmp_path):
    with pytest.raises(SettingsError, match="DRAFTLINE_TRAIN_NODES=2 needs DRAFTLINE_TRAIN_RDZV_ENDPOINT"):
        load_settings(TrainerSettings, data=tmp_path, model_dir=tmp_path, train_nodes=2)
    for endpoint in ("10.0.0.1", "10.0.0.1:port", ":29500", "10.0.0.1:70000"):
        with pytest.raises(SettingsError, match=f"DRAFTLINE_TRAIN_RDZV_ENDPOINT='{endpoint}' is not host:port"):
            load_settings(TrainerSettings, data=tmp_path, model_dir=tmp_path, train_nodes=2, train_rdzv_endpoint=endpoint)


def test_each_node_runs_torchrun_with_one_rendezvous_only_the_job_host_hosts_it():
    rendezvous = Rendezvous.new("r", "10.0.0.1:29500", 3)
    job = torchrun_args(rendezvous, host=True, timeout_s=60, local_addr="10.0.0.1")
    joiner = torchrun_args(rendezvous, host=False, timeout_s=60, local_addr=None)
    assert "--nnodes=3" in job and "--rdzv-backend=c10d" in job and "--max-restarts=0" in job
    assert f"--rdzv-id={rendezvous.id}" in job and f"--rdzv-id={rendezvous.id}" in joiner
    assert "--rdzv-conf=join_timeout=60,is_host=1" in job and "--rdzv-conf=join_timeout=60,is_host=0" in joiner
    assert "--local-addr=10.0.0.1" in job and not any(arg.startswith("--local-addr") for arg in joiner)
    assert Rendezvous.new("r", "h:1", 2).id != rendezvous.id  # a retry never meets a failed attempt's state


def test_the_ranks_get_the_timeout_that_bounds_their_collectives(tmp_path):
    settings = load_settings(TrainerSettings, data=tmp_path, model_dir=tmp_path, train_timeout_s=42)
    assert child_env(settings)["DRAFTLINE_TRAIN_TIMEOUT_S"] == "42.0"


def test_a_joining_node_names_an_unreachable_rendezvous_and_joins_each_training_once(redis_conn, redis_url, tmp_path,
                                                                                     caplog):
    settings = load_settings(TrainerSettings, data=tmp_path, model_dir=tmp_path, device="cpu", redis_url=redis_url,
                             train_timeout_s=1)
    announce(redis_conn, Rendezvous.new("r", f"127.0.0.1:{free_port()}", 2))  # nothing listens there
    polls = iter(range(3))
    join_trainings(settings, redis_conn, stop=lambda: next(polls, None) is None)
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 1, errors  # one attempt at the one training, however often it is seen
    assert "RendezvousUnreachable" in errors[0] and "unreachable from this node after 1s" in errors[0]
