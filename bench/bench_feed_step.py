"""What the online feed costs the training loop's thread a step, with every file already in.

Online training's loop does the feed's bookkeeping between two steps, after the step's one copy to the host has
waited for the GPU: it waits for the next batch (each sample's file looked at: its manifest entry, its header and
its done bit), looks whether the batches after it are whole to read them ahead, and after the step releases the
step's files and asks for the window's new samples. While it does, the GPU has nothing queued, so every
millisecond of it is added to the step (bench/RESULTS.md, issue 46: an online step of SmolLM2 on an H100 took 0.21 s
against offline's 0.107 s). Offline training does none of it: its figure, the baseline, is zero.

This measures that work alone, on a real redis-server and real files, at the shapes of the H100 run (batches of
16 samples), with an extraction that is never late: the window's files are written between steps, outside the
time measured. Each part is timed per step, its median and 90th percentile over the steps.

    python bench/bench_feed_step.py --samples 1024 --batch 16 --json feed.json

Results go to --json; bench/RESULTS.md and bench/results.json take them by hand, with the command.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.queues import SERIALIZER  # noqa: E402
from runtime.runstate import RunState  # noqa: E402
from runtime.spool import ONLINE_EVICTED, ONLINE_RELEASED  # noqa: E402
from services.trainer.batching import LENGTH  # noqa: E402
from services.trainer.online import Feed  # noqa: E402
from services.trainer.online_plan import OnlinePlan  # noqa: E402
from services.trainer.online_source import PREFETCH_BATCHES  # noqa: E402
from services.trainer.sources import epoch_plan  # noqa: E402
from shared.jobs import extract_job_id  # noqa: E402
from shared.runspec import TrainConfig  # noqa: E402
from tests.support.processes import RedisServer  # noqa: E402
from tests.support.spool_files import land as land_file  # noqa: E402

RUN = "feed"
PARTS = ("wait", "look_ahead", "after_step", "report")


def land(feed: Feed, sample_id: int, tokens: int) -> None:
    """A verified, recorded and counted file, as an extractor leaves it (small states: the feed reads headers), and
    its job gone, as a worker leaves a finished sample job (``DEFAULT_SAMPLE_RESULT_TTL_S`` 0)."""
    land_file(feed.state, sample_id, tokens)
    try:
        Job.fetch(extract_job_id(RUN, sample_id), connection=feed.state.conn, serializer=SERIALIZER).delete()
    except NoSuchJobError:
        pass


def extract_window(feed: Feed) -> None:
    """The extraction that is never late: every sample of the window without a file gets one."""
    for sample_id in feed.window.ids:
        if not feed.paths.hidden(sample_id).is_file():
            land(feed, sample_id, feed.tokens[sample_id])


def measure(args: argparse.Namespace, data: Path, conn: redis.Redis) -> tuple[dict[str, list[float]], dict[str, str]]:
    rng = random.Random(0)
    tokens = [rng.randint(64, 512) for _ in range(args.samples)]
    cfg = TrainConfig(batch_size=args.batch)
    plans = [epoch_plan(cfg, tokens, epoch, 1, LENGTH) for epoch in range(args.epochs)]
    state = RunState(conn, data, RUN)
    state.register(args.samples, state="training")
    feed = Feed(state, OnlinePlan(list(range(args.samples)), [], tokens), plans, rank=0, budget=args.budget,
                span=args.batch)
    feed.sizes.prior_per_token = 40.0
    feed.start()
    feed.settle(0, 0)
    timings: dict[str, list[float]] = {part: [] for part in PARTS}
    for epoch in range(len(plans)):
        for index in range(len(plans[epoch])):
            extract_window(feed)
            started = time.perf_counter()
            feed.wait_for(epoch, index)
            waited = time.perf_counter()
            for ahead in range(index + 1, min(index + 1 + PREFETCH_BATCHES, len(plans[epoch]))):
                if feed.settled(epoch, ahead) is None:
                    break
            looked = time.perf_counter()
            feed.after_step(epoch, index)
            stepped = time.perf_counter()
            feed.report(epoch, 0)
            reported = time.perf_counter()
            for part, seconds in zip(PARTS, (waited - started, looked - waited, stepped - looked, reported - stepped)):
                timings[part].append(seconds)
    return timings, state.meta()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": round(1000 * statistics.median(ordered), 3),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 3),
            "mean_ms": round(1000 * statistics.fmean(ordered), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget", type=int, default=20_000_000, help="bytes: at 40 a token, about 30 batches")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if min(args.samples, args.batch, args.epochs, args.budget) < 1 or args.samples < args.batch:
        parser.error("--samples, --batch, --epochs and --budget must be positive, and --samples at least --batch")
    with tempfile.TemporaryDirectory(prefix="bench-feed-") as work:
        server = RedisServer(Path(work) / "redis").start()
        try:
            conn = redis.Redis.from_url(server.url)
            timings, meta = measure(args, Path(work) / "data", conn)
        finally:
            server.stop()
    steps = len(timings["wait"])
    total = [sum(parts) for parts in zip(*timings.values())]
    result = {"bench": "feed_step", "machine": platform.node(), "python": platform.python_version(),
              "samples": args.samples, "batch": args.batch, "epochs": args.epochs, "steps": steps,
              "released": int(meta.get(ONLINE_RELEASED, 0)), "evicted": int(meta.get(ONLINE_EVICTED, 0)),
              "total": summary(total), **{part: summary(values) for part, values in timings.items()}}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
