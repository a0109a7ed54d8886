"""The orchestrator's own cost: samples per second through the generate and extract stages when the
servers answer at once, Redis memory per sample waiting in a queue and left after the run, the workers'
memory over the run, and Redis' commands and CPU per sample.

    python bench/bench_orchestration.py --samples 2000 --generators 2 --extractors 2 --json out.json
    python bench/bench_orchestration.py --samples 30 --generators 1 --extractors 1      # a quick check
    python bench/bench_orchestration.py --stages generate --samples 20000 --generators 2  # generation only
    python bench/bench_orchestration.py --samples 2000 --extract-server stub  # extraction against a stand-in

Everything is real except the target: a real redis-server, the controller's own submission and feeder
(``submit_run``, ``feed_run``, as its loop calls them), and ``draftline serve generator`` and ``draftline
serve extractor`` worker processes (RQ, JSON serializer, each job inline or in a forked work horse as
``--job-process`` says). Generation talks to a stand-in
OpenAI server in this process that answers every chat request at once with a fixed reply
(tests/support/openai_server.py); extraction to the built-in inference server on the tiny target
(a forward pass of a few thousand parameters per sample), or with ``--extract-server stub`` to a stand-in
in this process that writes zero states of the tiny target's shapes at once (tests/support/hidden_server.py),
so the extract rate is the orchestrator's own.

Each stage's workers start with RQ suspended, and the stage's clock starts once every one of them has
imported its modules and waits for its first job (an extractor's torch and tokenizer take seconds, no part
of the rate; ``startup_s``); a worker sees the resume within its 1 s suspension poll, which the stage's
time includes. The stages run one after the other so each is timed alone, with the extract backlog above
the run so nothing pauses generation: generation with no extractor running (its extract jobs wait in the
queue, which is what the Redis figure measures), then extraction. Rates are over the stage's wall time
from the first job queued to the last sample settled. With ``--stages generate`` only generation runs; its
extract jobs pile up in the queue, and are emptied afterwards to measure what the run left behind.

While a stage runs, a thread samples Redis' ``used_memory`` and the resident memory of each worker process
every ``--interval-s`` (the ``series``). Redis' ``INFO commandstats`` and ``INFO cpu`` before and after each
stage give its commands and CPU seconds per sample; they include the bench's own polling (a feed and a count
every 50 ms, more often than the controller's 1 s), so they overstate the pipeline's share a little.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402
from rq import Worker  # noqa: E402
from rq.suspension import resume, suspend  # noqa: E402
from rq.worker import WorkerStatus  # noqa: E402

from services.controller.loop.feeder import feed_run  # noqa: E402
from services.controller.runs.submit import submit_run  # noqa: E402
from shared.jobs import EXTRACT_QUEUE, GENERATE_QUEUE, payload_sample_ids  # noqa: E402
from runtime.queues import queue  # noqa: E402
from shared.runspec import EvalConfig, GenerationConfig, RunSpec  # noqa: E402
from runtime.runstate import RunState  # noqa: E402
from shared.settings import ControllerSettings, GeneratorSettings, configure_logging  # noqa: E402
from tests.support.hidden_server import HiddenStateServer  # noqa: E402
from tests.support.openai_server import OpenAIServer, Reply  # noqa: E402
from tests.support.processes import RedisServer, ServiceProcess, free_port  # noqa: E402
from tests.support.tiny_target import cached_tiny_model  # noqa: E402

log = logging.getLogger("bench_orchestration")
RUN = "orchestration"
POLL_S = 0.05  # how often the bench reads a stage's counts
BASELINE_S = 3.0  # how long it measures its own polling before a stage
REPLY = "a fixed reply of a dozen words from the stand-in target, at once"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--stages", choices=("both", "generate"), default="both",
                        help="both stages one after the other, or generation only (against the stand-in server)")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--extractors", type=int, default=2)
    parser.add_argument("--extract-server", choices=("builtin", "stub"), default="builtin",
                        help="extraction against the built-in server on the tiny target (a real forward), or "
                        "against a stand-in that writes zero states of the tiny target's shapes at once")
    parser.add_argument("--generate-batch", type=int, default=16, help="samples per generate job (the controller's)")
    parser.add_argument("--extract-batch", type=int, default=None,
                        help="DRAFTLINE_EXTRACT_BATCH, most samples per extract job, for the feeder and the generators "
                        "(default: the setting's)")
    parser.add_argument("--sample-result-ttl-s", type=int, default=None,
                        help="DRAFTLINE_SAMPLE_RESULT_TTL_S for the feeder and the workers (default: the setting's)")
    parser.add_argument("--job-process", choices=("fork", "inline"), default=None,
                        help="DRAFTLINE_JOB_PROCESS of the workers: each job in a forked work horse, or in the worker "
                        "itself (default: the setting's)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between two memory samples")
    parser.add_argument("--work", type=Path, default=None, help="data, Redis and logs (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (its work horses come and go; the worker itself stays); 0 once gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def redis_counters(conn: redis.Redis) -> dict:
    """Commands Redis ran so far (by name; INFO, the bench's own sampling, left out) and its CPU seconds."""
    calls = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in conn.info("commandstats").items()}
    calls.pop("info", None)
    cpu = conn.info("cpu")
    return {"calls": calls, "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"]}


def counters_delta(before: dict, after: dict, samples: int) -> dict:
    """Commands and CPU between two ``redis_counters`` readings, per sample and per command."""
    calls = {name: n - before["calls"].get(name, 0) for name, n in after["calls"].items()}
    calls = {name: n for name, n in sorted(calls.items(), key=lambda item: -item[1]) if n}
    total, cpu_s = sum(calls.values()), after["cpu_s"] - before["cpu_s"]
    return {"commands": total, "commands_per_sample": round(total / max(1, samples), 1),
            "cpu_s": round(cpu_s, 3), "cpu_us_per_command": round(1e6 * cpu_s / max(1, total), 2),
            "cpu_us_per_sample": round(1e6 * cpu_s / max(1, samples), 1),
            "by_command_per_sample": {name: round(n / max(1, samples), 2) for name, n in calls.items()}}


def key_bytes(conn: redis.Redis) -> tuple[int, int]:
    """(keys, bytes they hold by MEMORY USAGE): the data, without the server's own overhead (its Lua
    scripts, client buffers, hash tables sized for the most keys it held) that ``used_memory`` includes."""
    keys = total = 0
    for key in conn.scan_iter(count=1000):
        keys, total = keys + 1, total + (conn.memory_usage(key, samples=0) or 0)
    return keys, total


class MemorySampler:
    """Samples Redis memory, the queues and each worker's RSS every ``interval_s`` on a thread of its own."""

    def __init__(self, url: str, state: RunState, stage: str, pids: list[int], interval_s: float) -> None:
        self.conn = redis.Redis.from_url(url)
        self.state, self.stage, self.pids, self.interval_s = state, stage, pids, interval_s
        self.series: list[dict] = []
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=f"sampler-{stage}", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the stage's last point
        self.conn.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        counts = self.state.counts(self.stage)
        self.series.append({
            "t_s": round(time.perf_counter() - self._started, 2), "settled": counts.done + counts.failed + counts.dropped,
            "redis_used_memory": self.conn.info("memory")["used_memory"],
            "generate_jobs_waiting": queue(GENERATE_QUEUE, self.conn).count,
            "extract_jobs_waiting": queue(EXTRACT_QUEUE, self.conn).count,
            "worker_rss_bytes": [rss_bytes(pid) for pid in self.pids],
        })

    def summary(self) -> dict:
        """Peak Redis memory, and each worker's RSS at its start, at the end and at its highest; the start is
        the first point after a sample settled, since a worker still importing its modules has not grown yet."""
        serving = [point for point in self.series if point["settled"]] or self.series
        rss = [[point["worker_rss_bytes"][i] for point in serving if point["worker_rss_bytes"][i]]
               for i in range(len(self.pids))]
        return {"redis_used_memory_peak": max(point["redis_used_memory"] for point in self.series),
                "worker_rss_start_end_peak": [[r[0], r[-1], max(r)] if r else [0, 0, 0] for r in rss]}


def settle(stage: str, state: RunState, feeder: ControllerSettings, conn: redis.Redis, workers: list[ServiceProcess],
           deadline: float) -> float:
    """Feed until every sample of ``stage`` is done, failed or dropped; the stage's seconds."""
    started = fed = time.perf_counter()
    feed_run(feeder, RunState(conn, feeder.data, RUN))
    while time.perf_counter() < deadline:
        if time.perf_counter() - fed >= feeder.feed_interval_s:  # the controller's loop feeds at this pace
            feed_run(feeder, RunState(conn, feeder.data, RUN))
            fed = time.perf_counter()
        counts = state.counts(stage)
        if counts.done + counts.failed + counts.dropped >= state.expected():
            return time.perf_counter() - started
        for worker in workers:
            if not worker.alive():
                raise RuntimeError(f"{worker.name} died:\n{worker.log()}")
        time.sleep(POLL_S)
    raise TimeoutError(f"{stage} did not settle: {state.counts(stage)}")


def polling_cost(bench: Bench, stage: str) -> dict:
    """Redis' commands and CPU per second while the bench polls and feeds as ``settle`` does but no worker
    runs: the share of a stage's figures that is the bench's own, with Redis' idle housekeeping."""
    before, started = redis_counters(bench.conn), time.perf_counter()
    with MemorySampler(bench.url, bench.state, stage, [], bench.args.interval_s):
        while time.perf_counter() - started < BASELINE_S:
            feed_run(bench.feeder, RunState(bench.conn, bench.feeder.data, RUN))
            for _ in range(round(bench.feeder.feed_interval_s / POLL_S)):
                bench.state.counts(stage)
                time.sleep(POLL_S)
    seconds, after = time.perf_counter() - started, redis_counters(bench.conn)
    calls = {name: (n - before["calls"].get(name, 0)) / seconds for name, n in after["calls"].items()}
    return {"calls": calls, "cpu_s": (after["cpu_s"] - before["cpu_s"]) / seconds}


def net_of_polling(before: dict, after: dict, polling: dict, seconds: float) -> dict:
    """``after`` less what polling for ``seconds`` adds to ``before``: the workers' own share."""
    calls = {name: n - before["calls"].get(name, 0) - polling["calls"].get(name, 0) * seconds
             for name, n in after["calls"].items()}
    return {"calls": {name: max(0, round(n)) for name, n in calls.items()},
            "cpu_s": max(0.0, after["cpu_s"] - before["cpu_s"] - polling["cpu_s"] * seconds)}


@dataclass
class Bench:
    """What the stages of one benchmark run share."""

    args: argparse.Namespace
    base_env: dict[str, str]  # every worker's environment: Redis, the volume, the sample-job TTL
    logs: Path
    state: RunState
    feeder: ControllerSettings
    conn: redis.Redis
    url: str
    model_dir: Path
    deadline: float


def stage(bench: Bench, name: str, service: str, count: int, env: dict[str, str]) -> dict:
    """``count`` worker processes of ``service`` until the stage settles: its seconds, the workers' memory
    at the end, the memory series, and Redis' commands and CPU per sample of the stage."""
    polling = polling_cost(bench, name)
    before = redis_counters(bench.conn)
    suspend(bench.conn)  # the workers start, import and register first; the stage's clock starts after
    workers = [ServiceProcess(service, {**bench.base_env, **env}, bench.logs).start() for _ in range(count)]
    try:
        startup_s = wait_suspended(bench, workers)
        resume(bench.conn)
        pids = [w.proc.pid for w in workers]
        with MemorySampler(bench.url, bench.state, name, pids, bench.args.interval_s) as sampler:
            seconds = settle(name, bench.state, bench.feeder, bench.conn, workers, bench.deadline)
        rss = [rss_bytes(pid) for pid in pids]
    finally:
        for worker in workers:
            worker.stop()
    after, samples = redis_counters(bench.conn), bench.state.expected()
    redis_figures = {"with_polling": counters_delta(before, after, samples),
                     "workers_only": counters_delta({"calls": {}, "cpu_s": 0.0},
                                                    net_of_polling(before, after, polling, seconds), samples),
                     "polling_commands_per_s": round(sum(polling["calls"].values()), 1),
                     "polling_cpu_s_per_s": round(polling["cpu_s"], 4)}
    return {"seconds": seconds, "startup_s": startup_s, "rss": rss, "series": sampler.series, **sampler.summary(),
            "redis": redis_figures}


def wait_suspended(bench: Bench, workers: list[ServiceProcess]) -> float:
    """Seconds until every worker of ``workers`` has started and waits, suspended, for its first job: an
    extractor imports torch and loads a tokenizer first, which is no part of the stage's rate."""
    started = time.perf_counter()
    while time.perf_counter() < bench.deadline:
        ready = [w for w in Worker.all(connection=bench.conn) if w.get_state() == WorkerStatus.SUSPENDED]
        if len(ready) >= len(workers):
            return round(time.perf_counter() - started, 2)
        for worker in workers:
            if not worker.alive():
                raise RuntimeError(f"{worker.name} died:\n{worker.log()}")
        time.sleep(POLL_S)
    raise TimeoutError("the workers did not start")


def generate(bench: Bench) -> dict:
    """The generate stage against the stand-in server, and Redis per sample waiting in a generate job first."""
    conn = bench.conn
    memory_before = conn.info("memory")["used_memory"]
    # The first tick fills the feed window before any worker runs.
    feed_run(bench.feeder, RunState(conn, bench.feeder.data, RUN))
    waiting_generate = sum(len(job.args[0]["items"]) for job in queue(GENERATE_QUEUE, conn).get_jobs())
    per_generate_sample = (conn.info("memory")["used_memory"] - memory_before) / max(1, waiting_generate)
    with OpenAIServer(model=bench.model_dir.name) as chat:
        chat.set_default(Reply(REPLY))
        result = stage(bench, "generate", "generator", bench.args.generators, {"DRAFTLINE_INFERENCE_URL": chat.url})
    return {**result, "generate_samples_waiting": waiting_generate,
            "redis_bytes_per_sample_in_generate_jobs": round(per_generate_sample)}


def extract(bench: Bench) -> dict:
    """The extract stage against the built-in server on the tiny target, or against the stand-in."""
    if bench.args.extract_server == "stub":
        return extract_stub(bench)
    port, model_dir = free_port(), str(bench.model_dir)
    inference = ServiceProcess("inference", {**bench.base_env, "DRAFTLINE_MODEL_DIR": model_dir, "DRAFTLINE_DEVICE": "cpu",
                                             "DRAFTLINE_PORT": str(port), "DRAFTLINE_HOST": "127.0.0.1"}, bench.logs,
                               health_url=f"http://127.0.0.1:{port}/health").start()
    try:
        env = {"DRAFTLINE_HIDDEN_STATES_URL": f"http://127.0.0.1:{port}", "DRAFTLINE_MODEL_DIR": model_dir}
        return stage(bench, "extract", "extractor", bench.args.extractors, env)
    finally:
        inference.stop()


def extract_stub(bench: Bench) -> dict:
    """The extract stage against a stand-in that writes states of the tiny target's shapes at once: what is
    left is the orchestrator's own cost (and the file's write, which the protocol gives the server)."""
    config = json.loads((bench.model_dir / "config.json").read_text(encoding="utf-8"))
    with HiddenStateServer(bench.base_env["DRAFTLINE_DATA"], hidden_size=config["hidden_size"],
                           num_layers=config["num_hidden_layers"], model=bench.model_dir.name) as server:
        env = {"DRAFTLINE_HIDDEN_STATES_URL": server.url, "DRAFTLINE_MODEL_DIR": str(bench.model_dir)}
        return stage(bench, "extract", "extractor", bench.args.extractors, env)


def stage_report(result: dict) -> dict:
    return {"seconds": round(result["seconds"], 2), "startup_s": result["startup_s"],
            "redis_used_memory_peak": result["redis_used_memory_peak"],
            "worker_rss_start_end_peak_bytes": result["worker_rss_start_end_peak"], "redis": result["redis"],
            "series": result["series"]}


def run(args: argparse.Namespace, work: Path) -> dict:
    data, logs = work / "data", work / "logs"
    data.mkdir(parents=True, exist_ok=True)
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"question number {i}: say something"}) + "\n"
                               for i in range(args.samples)), encoding="utf-8")
    model_dir = cached_tiny_model()
    redis_server = RedisServer(work / "redis").start()
    conn = redis.Redis.from_url(redis_server.url)
    try:
        submit_run(data, conn, RunSpec(dataset=str(dataset), name=RUN, model=model_dir.name,
                                       generation=GenerationConfig(min_completion_tokens=1),
                                       evaluate=EvalConfig(holdout=0)))
        state = RunState(conn, data, RUN)
        ttl = {} if args.sample_result_ttl_s is None else {"sample_result_ttl_s": args.sample_result_ttl_s}
        ttl |= {} if args.extract_batch is None else {"extract_batch": args.extract_batch}
        # Generation never waits for extraction, which runs after it (or not at all): the backlog holds the
        # whole run, else a run of more than backlog × extract_batch samples would never finish generating.
        feeder = ControllerSettings(data=data, generate_batch=args.generate_batch, extract_backlog=args.samples + 1,
                                    **ttl)
        base = {"REDIS_URL": redis_server.url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_LOG_LEVEL": "WARNING",
                "DRAFTLINE_SAMPLE_RESULT_TTL_S": str(feeder.sample_result_ttl_s),
                "DRAFTLINE_EXTRACT_BATCH": str(feeder.extract_batch),
                "DRAFTLINE_JOB_PROCESS": args.job_process or GeneratorSettings.model_fields["job_process"].default}
        bench = Bench(args, base, logs, state, feeder, conn, redis_server.url, model_dir,
                      deadline=time.perf_counter() + args.timeout_s)
        memory_before = conn.info("memory")["used_memory"]
        gen_result = generate(bench)
        waiting = queue(EXTRACT_QUEUE, conn).count
        waiting_samples = sum(len(payload_sample_ids(job.args[0])) for job in queue(EXTRACT_QUEUE, conn).get_jobs())
        memory_waiting = conn.info("memory")["used_memory"]
        stages = {"generate": gen_result}
        if args.stages == "both":
            stages["extract"] = extract(bench)
        else:
            queue(EXTRACT_QUEUE, conn).empty()  # what extractors that keep nothing would leave: no extract job
        memory_after = conn.info("memory")["used_memory"]
        keys_after, key_bytes_after = key_bytes(conn)
        gen, ext = state.counts("generate"), state.counts("extract")
        report = {
            "samples": args.samples, "stages": args.stages, "generators": args.generators,
            "extractors": args.extractors if args.stages == "both" else 0, "generate_batch": args.generate_batch,
            "extract_batch": feeder.extract_batch, "extract_server": args.extract_server,
            "sample_result_ttl_s": feeder.sample_result_ttl_s, "job_process": base["DRAFTLINE_JOB_PROCESS"],
            "cpus": os.cpu_count(),
            "generated": gen.done, "generate_failed": gen.failed, "extracted": ext.done, "extract_failed": ext.failed,
            "generate_s": round(gen_result["seconds"], 2),
            "generate_samples_per_s_stub": round(gen.done / gen_result["seconds"], 1),
            "extract_jobs_waiting": waiting, "extract_samples_waiting": waiting_samples,
            "redis_bytes_per_sample_in_generate_jobs": gen_result["redis_bytes_per_sample_in_generate_jobs"],
            "redis_bytes_per_inflight_sample": round((memory_waiting - memory_before) / max(1, waiting_samples)),
            "redis_bytes_per_waiting_extract_job": round((memory_waiting - memory_before) / max(1, waiting)),
            "redis_used_memory": {"before": memory_before, "extract_jobs_waiting": memory_waiting, "after": memory_after,
                                  "peak_sampled": max(r["redis_used_memory_peak"] for r in stages.values()),
                                  "peak_reported_by_redis": conn.info("memory")["used_memory_peak"]},
            "redis_bytes_per_sample_after_run": round((memory_after - memory_before) / max(1, gen.done)),
            "redis_keys_after_run": keys_after, "redis_key_bytes_after_run": key_bytes_after,
            "redis_key_bytes_per_sample_after_run": round(key_bytes_after / max(1, gen.done)),
            "worker_rss_bytes": {"generator": gen_result["rss"]},
            "redis_commands_and_cpu": {name: result["redis"] for name, result in stages.items()},
            "stage_detail": {name: stage_report(result) for name, result in stages.items()},
        }
        if "extract" in stages:
            report.update(extract_s=round(stages["extract"]["seconds"], 2),
                          extract_samples_per_s_stub=round(ext.done / stages["extract"]["seconds"], 1))
            report["worker_rss_bytes"]["extractor"] = stages["extract"]["rss"]
        return report
    finally:
        conn.close()
        redis_server.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("WARNING")
    if args.work is not None:
        report = run(args, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-orchestration-") as tmp:
            report = run(args, Path(tmp))
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
        args.json.write_text(line + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
