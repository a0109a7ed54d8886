"""Redis ACL users per role (runtime/redis_acl.py, redis/start.sh) on a real redis-server started the way
the compose stack starts it: each role does its work, and is refused what it may not do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from rq.job import Job

import redis
from services.controller.loop.feeder import feed_run
from services.controller.runs.submit import submit_run
from shared import metrics
from shared.errors import SettingsError
from shared.jobs import GENERATE_QUEUE, generate_job_id
from runtime.queues import queue
from runtime.redis_acl import (
    ROLES,
    configured_passwords,
    render_roles_file,
    server_arguments,
)
from shared.runspec import EvalConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from shared.settings import ControllerSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.services.exporter.scrape import value
from tests.services.exporter.test_collector import scrape
from tests.runtime.test_worker import wait_for
from tests.support.openai_server import OpenAIServer, Reply
from tests.support.processes import REPO, RedisServer, ServiceProcess
from tests.support.workers import successful_jobs

ADMIN_PASSWORD = "admin-pw-0123"
PASSWORDS = {"controller": "controller-pw-0123", "worker": "worker-pw-0123", "exporter": "exporter-pw-0123"}
ROLE_ENV = {ROLES[name].password_variable: password for name, password in PASSWORDS.items()}


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis-acl"), acl_env={"REDIS_PASSWORD": ADMIN_PASSWORD, **ROLE_ENV})
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def acl(acl_server: RedisServer) -> RedisServer:
    redis.Redis.from_url(acl_server.url).flushall()
    return acl_server


def connect(server: RedisServer, role: str, password: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(server.url_for(role, password or PASSWORDS[role]))


def test_the_shipped_roles_file_is_what_the_module_renders() -> None:
    assert (REPO / "redis" / "roles.acl").read_text() == render_roles_file()


def test_no_role_password_adds_no_user(tmp_path: Path) -> None:
    assert server_arguments({}) == [] and server_arguments({name: "" for name in ROLE_ENV}) == []
    server = RedisServer(tmp_path, acl_env={"REDIS_PASSWORD": ADMIN_PASSWORD}).start()
    try:
        conn = redis.Redis.from_url(server.url)
        assert conn.acl_users() == ["default"]
        assert conn.set("k", "v") and conn.flushall()  # the default user, as before roles: every command
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url_for("", "wrong")).ping()
    finally:
        server.stop()


def test_each_role_password_adds_exactly_its_user() -> None:
    for name, role in ROLES.items():
        arguments = server_arguments({role.password_variable: PASSWORDS[name]})
        assert arguments[:5] == ["--user", name, "reset", "on", f">{PASSWORDS[name]}"]
        assert arguments.count("--user") == 1
    assert set(configured_passwords(ROLE_ENV)) == set(ROLES)


def test_the_server_has_the_default_user_and_one_user_per_role(acl: RedisServer) -> None:
    assert sorted(redis.Redis.from_url(acl.url).acl_users()) == sorted(["default", *ROLES])


def test_a_password_outside_url_safe_characters_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="DRAFTLINE_REDIS_WORKER_PASSWORD"):
        configured_passwords({"DRAFTLINE_REDIS_WORKER_PASSWORD": "a b@c"})
    started = subprocess.run(
        ["sh", str(REPO / "redis" / "start.sh"), "--port", "0"], capture_output=True, text=True, timeout=30, check=False,
        env={"PATH": "/usr/bin:/bin", "REDIS_PASSWORD": ADMIN_PASSWORD, "DRAFTLINE_REDIS_WORKER_PASSWORD": "a b"},
    )
    assert started.returncode == 2 and "DRAFTLINE_REDIS_WORKER_PASSWORD" in started.stderr


def test_a_wrong_password_is_refused_for_every_role(acl: RedisServer) -> None:
    for name in ROLES:
        with pytest.raises(redis.AuthenticationError):
            connect(acl, name, "wrong-password").ping()
        with pytest.raises(redis.AuthenticationError):  # another role's password is no better
            connect(acl, name, next(p for other, p in PASSWORDS.items() if other != name)).ping()


@pytest.mark.parametrize("role", ["controller", "worker"])
def test_read_write_roles_may_not_administer_the_server(acl: RedisServer, role: str) -> None:
    conn = connect(acl, role)
    conn.set(f"{role}:k", "v")
    for command in (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"), ("CONFIG", "GET", "*"),
                    ("ACL", "LIST"), ("SHUTDOWN", "NOSAVE"), ("SWAPDB", "0", "1"), ("KEYS", "*"),
                    ("REPLICAOF", "NO", "ONE"), ("BGSAVE",), ("MODULE", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            conn.execute_command(*command)
    assert conn.get(f"{role}:k") == b"v"


def test_the_exporter_may_read_but_never_write(acl: RedisServer) -> None:
    connect(acl, "controller").hset("h", "f", "1")
    exporter = connect(acl, "exporter")
    assert exporter.hgetall("h") == {b"f": b"1"} and exporter.ping() and "redis_version" in exporter.info("server")
    for write in (lambda: exporter.set("k", "v"), lambda: exporter.hset("h", "f", "2"),
                  lambda: exporter.srem("rq:workers", "x"), lambda: exporter.publish("rq:pubsub:x", "stop"),
                  lambda: queue(GENERATE_QUEUE, exporter).enqueue("time.sleep", 0),
                  lambda: exporter.eval("return 1", 0), lambda: exporter.execute_command("FLUSHALL")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    assert exporter.hget("h", "f") == b"1"


def test_controller_feeds_a_worker_generates_and_the_exporter_reports_each_as_its_role_user(
    acl: RedisServer, data_dir: Path, tmp_path: Path
) -> None:
    controller = connect(acl, "controller")
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(5)])
    submit_run(data_dir, controller, RunSpec(dataset=str(dataset), name="acl", model="stand-in-target",
                                             generation=GenerationConfig(min_completion_tokens=1),
                                             evaluate=EvalConfig(holdout=1)))
    settings = ControllerSettings(data=data_dir, generate_batch=2, feed_window=8, extract_backlog=100)
    assert feed_run(settings, RunState(controller, settings.data, "acl")) == 2  # 4 prompts, 2 per job
    state = RunState(controller, data_dir, "acl")
    with OpenAIServer() as server:
        server.set_default(Reply("a reply"))
        env = {"REDIS_URL": acl.url_for("worker", PASSWORDS["worker"]), "DRAFTLINE_DATA": str(data_dir),
               "DRAFTLINE_INFERENCE_URL": server.url}
        worker = ServiceProcess("generator", env=env, log_dir=tmp_path / "logs").start()
        admin = redis.Redis.from_url(acl.url)
        try:
            wait_for(lambda: state.counts("generate").done == 4, "4 generated samples", 120, worker)
            # A job's samples land before the worker settles the job in RQ (a finished sample job is deleted
            # at once, and the worker counts it in its own hash): wait for both jobs to be settled.
            wait_for(lambda: list(successful_jobs(admin).values()) == [2], "both generate jobs settled", 60, worker)
            assert not any(controller.exists(Job.key_for(generate_job_id("acl", i))) for i in (0, 2))
            # A registration whose worker hash expired: RQ's Worker.all() would SREM it, which the
            # exporter may not; the exporter skips it and leaves it to the workers.
            admin.sadd(f"rq:workers:{GENERATE_QUEUE}", "rq:worker:gone")
            exporter_url = acl.url_for("exporter", PASSWORDS["exporter"])
            # The worker turns idle after its last job is marked finished.
            wait_for(lambda: value(scrape(exporter_url, data_dir), metrics.QUEUE_WORKERS, queue=GENERATE_QUEUE,
                                   state="idle") == 1, "the worker reported idle by the exporter", 30, worker)
            samples = scrape(exporter_url, data_dir)
            assert value(samples, metrics.REDIS_UP) == 1
            assert value(samples, metrics.STAGE_DONE, run="acl", stage="generate") == 4
            assert value(samples, metrics.QUEUE_WORKERS, queue=GENERATE_QUEUE, state="idle") == 1
            assert admin.sismember(f"rq:workers:{GENERATE_QUEUE}", "rq:worker:gone")
        finally:
            worker.stop()
    assert "NOPERM" not in worker.full_log(), worker.log()
