"""The orchestrator's own cost: samples per second through the generate and extract stages when the
servers answer at once, Redis memory per sample waiting in a queue, and the workers' memory.

    python bench/bench_orchestration.py --samples 2000 --generators 2 --extractors 2 --json out.json
    python bench/bench_orchestration.py --samples 30 --generators 1 --extractors 1      # a quick check

Everything is real except the target: a real redis-server, the controller's own submission and feeder
(``submit_run``, ``feed_run``, as its loop calls them), and ``draftline serve generator`` and ``draftline
serve extractor`` worker processes (RQ, JSON serializer, fork per job). Generation talks to a stand-in
OpenAI server in this process that answers every chat request at once with a fixed reply
(tests/support/openai_server.py); extraction to the built-in inference server on the tiny target
(a forward pass of a few thousand parameters per sample, so the workers' own cost shows).

The stages run one after the other so each is timed alone: generation with no extractor running (its
extract jobs wait in the queue, which is what the Redis figure measures), then extraction. Rates are over
the stage's wall time from the first job queued to the last sample settled. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from services.controller.feeder import feed_run  # noqa: E402
from services.controller.submit import submit_run  # noqa: E402
from shared.jobs import EXTRACT_QUEUE  # noqa: E402
from shared.queues import queue  # noqa: E402
from shared.runspec import EvalConfig, GenerationConfig  # noqa: E402
from shared.runstate import RunState  # noqa: E402
from shared.settings import ControllerSettings, configure_logging  # noqa: E402
from tests.support.openai_server import OpenAIServer, Reply  # noqa: E402
from tests.support.processes import RedisServer, ServiceProcess, free_port  # noqa: E402
from tests.support.tiny_target import cached_tiny_model  # noqa: E402

log = logging.getLogger("bench_orchestration")
RUN = "orchestration"
REPLY = "a fixed reply of a dozen words from the stand-in target, at once"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--extractors", type=int, default=2)
    parser.add_argument("--generate-batch", type=int, default=16, help="samples per generate job (the controller's)")
    parser.add_argument("--work", type=Path, default=None, help="data, Redis and logs (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (its work horses come and go; the worker itself stays)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def settle(stage: str, state: RunState, feeder: ControllerSettings, conn: redis.Redis, workers: list[ServiceProcess],
           deadline: float) -> float:
    """Feed until every sample of ``stage`` is done, failed or dropped; the stage's seconds."""
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        feed_run(feeder, conn, RUN)  # what the controller's loop does every tick
        counts = state.counts(stage)
        if counts.done + counts.failed + counts.dropped >= state.expected():
            return time.perf_counter() - started
        for worker in workers:
            if not worker.alive():
                raise RuntimeError(f"{worker.name} died:\n{worker.log()}")
        time.sleep(0.05)
    raise TimeoutError(f"{stage} did not settle: {state.counts(stage)}")


def stage(name: str, service: str, count: int, env: dict[str, str], logs: Path, state: RunState,
          feeder: ControllerSettings, conn: redis.Redis, deadline: float) -> tuple[float, list[int]]:
    """``count`` worker processes of ``service`` until the stage settles: its seconds and the workers' memory."""
    workers = [ServiceProcess(service, env, logs).start() for _ in range(count)]
    try:
        seconds = settle(name, state, feeder, conn, workers, deadline)
        return seconds, [rss_bytes(w.proc.pid) for w in workers]
    finally:
        for worker in workers:
            worker.stop()


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
        submit_run(data, conn, dataset=str(dataset), name=RUN, model=model_dir.name,
                   generation=GenerationConfig(min_completion_tokens=1), evaluate=EvalConfig(holdout=0))
        state = RunState(conn, data, RUN)
        feeder = ControllerSettings(data=data, generate_batch=args.generate_batch)
        base = {"REDIS_URL": redis_server.url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_LOG_LEVEL": "WARNING"}
        deadline = time.perf_counter() + args.timeout_s
        memory_before = conn.info("memory")["used_memory"]
        with OpenAIServer(model=model_dir.name) as chat:
            chat.set_default(Reply(REPLY))
            env = {**base, "DRAFTLINE_INFERENCE_URL": chat.url}
            generate_s, generator_rss = stage("generate", "generator", args.generators, env, logs, state, feeder, conn,
                                              deadline)
        waiting = queue(EXTRACT_QUEUE, conn).count
        memory_waiting = conn.info("memory")["used_memory"]
        port = free_port()
        inference = ServiceProcess("inference", {**base, "DRAFTLINE_MODEL_DIR": str(model_dir), "DRAFTLINE_DEVICE": "cpu",
                                                 "DRAFTLINE_PORT": str(port), "DRAFTLINE_HOST": "127.0.0.1"}, logs,
                                   health_url=f"http://127.0.0.1:{port}/health").start()
        try:
            env = {**base, "DRAFTLINE_HIDDEN_STATES_URL": f"http://127.0.0.1:{port}", "DRAFTLINE_MODEL_DIR": str(model_dir)}
            extract_s, extractor_rss = stage("extract", "extractor", args.extractors, env, logs, state, feeder, conn,
                                             deadline)
        finally:
            inference.stop()
        memory_after = conn.info("memory")["used_memory"]
        gen, ext = state.counts("generate"), state.counts("extract")
        return {
            "samples": args.samples, "generators": args.generators, "extractors": args.extractors,
            "generate_batch": args.generate_batch, "cpus": os.cpu_count(),
            "generated": gen.done, "generate_failed": gen.failed, "extracted": ext.done, "extract_failed": ext.failed,
            "generate_s": round(generate_s, 2), "extract_s": round(extract_s, 2),
            "generate_samples_per_s_stub": round(gen.done / generate_s, 1),
            "extract_samples_per_s_stub": round(ext.done / extract_s, 1),
            "extract_jobs_waiting": waiting,
            "redis_bytes_per_inflight_sample": round((memory_waiting - memory_before) / max(1, waiting)),
            "redis_used_memory": {"before": memory_before, "extract_jobs_waiting": memory_waiting, "after": memory_after},
            "redis_bytes_per_sample_after_run": round((memory_after - memory_before) / max(1, ext.done)),
            "worker_rss_bytes": {"generator": generator_rss, "extractor": extractor_rss},
        }
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
