"""Hidden-state extraction speed: a bare forward pass against the endpoint's pipeline, same samples.

    python bench/bench_hidden_states.py --model-dir models/tiny --lengths 128,512 --samples 32

"bare" runs the decoder stack over the same token-budget groups and keeps nothing; "pipeline" runs
``HiddenStatePipeline`` (forward with hidden states, copies to host, serialization, atomic writes on
the writer pool) until every file is on disk. With ``--url`` the samples also go through a running
server's ``/v1/hidden_states`` (its data volume must be ``--out``'s filesystem view; paths are sent
relative). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.inference.hidden import HiddenJob, right_pad
from services.inference.model import LoadedModel, load_model
from services.inference.pipeline import HiddenStatePipeline
from shared.layout import RunPaths
from shared.settings import InferenceSettings, configure_logging

log = logging.getLogger("bench_hidden_states")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--lengths", default="512,1024,2048", help="sample lengths in tokens, used round-robin")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--writer-threads", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="where files go (default: a temp dir, removed)")
    parser.add_argument("--url", default=None, help="also time a running server's /v1/hidden_states")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight with --url")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_jobs(loaded: LoadedModel, lengths: list[int], count: int, out: Path, seed: int) -> list[HiddenJob]:
    gen = torch.Generator().manual_seed(seed)
    layer_ids = tuple(loaded.default_layer_ids())
    jobs = []
    for i in range(count):
        length = lengths[i % len(lengths)]
        ids = torch.randint(0, loaded.vocab_size, (length,), generator=gen).tolist()
        rel = RunPaths(out, "bench").hidden_relative(i)  # the server writes only into runs' hidden-state folders
        jobs.append(HiddenJob(ids, [1] * length, out / rel, rel, layer_ids, {"bench": "1"}))
    return jobs


def plan_groups(jobs: list[HiddenJob], budget: int) -> list[list[HiddenJob]]:
    """The pipeline's rule on a full queue: add samples while longest × count stays within the budget."""
    groups: list[list[HiddenJob]] = []
    for job in jobs:
        group = groups[-1] if groups else None
        if group and max(job.num_tokens, *(j.num_tokens for j in group)) * (len(group) + 1) <= budget:
            group.append(job)
        else:
            groups.append([job])
    return groups


def synchronize(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


def bare_forward_seconds(loaded: LoadedModel, groups: list[list[HiddenJob]]) -> float:
    with torch.inference_mode():
        run = lambda group: loaded.model.base_model(*right_pad(group, loaded.pad_token_id, loaded.device),  # noqa: E731
                                                    use_cache=False)
        run(groups[0])  # warm-up: kernels, allocator
        synchronize(loaded)
        started = time.perf_counter()
        for group in groups:
            run(group)
        synchronize(loaded)
    return time.perf_counter() - started


def pipeline_seconds(loaded: LoadedModel, jobs: list[HiddenJob], args: argparse.Namespace) -> tuple[float, int]:
    pipeline = HiddenStatePipeline(loaded, batch_tokens=args.batch_tokens, writer_threads=args.writer_threads).start()
    try:
        pipeline.submit(jobs[0]).result()  # warm-up
        started = time.perf_counter()
        futures = [pipeline.submit(job) for job in jobs]
        written = sum(f.result().bytes for f in futures)
        return time.perf_counter() - started, written
    finally:
        pipeline.stop()


def http_seconds(url: str, jobs: list[HiddenJob], concurrency: int) -> float:
    import httpx

    def post(client: httpx.Client, job: HiddenJob) -> None:
        body = {"input_ids": job.input_ids, "loss_mask": job.loss_mask, "path": job.relative_path,
                "layer_ids": list(job.layer_ids)}
        client.post(url.rstrip("/") + "/v1/hidden_states", json=body, timeout=600).raise_for_status()

    with httpx.Client(limits=httpx.Limits(max_connections=concurrency)) as client:
        post(client, jobs[0])
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda job: post(client, job), jobs))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("WARNING")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-hidden-"))
    settings = InferenceSettings(model_dir=args.model_dir, data=out, device=args.device, dtype=args.dtype)
    loaded = load_model(settings)
    lengths = [int(n) for n in args.lengths.split(",")]
    jobs = make_jobs(loaded, lengths, args.samples, out, args.seed)
    tokens = sum(job.num_tokens for job in jobs)
    try:
        bare = bare_forward_seconds(loaded, plan_groups(jobs, args.batch_tokens))
        piped, written = pipeline_seconds(loaded, jobs, args)
        report = {
            "model": loaded.name, "device": str(loaded.device), "dtype": loaded.dtype_name,
            "samples": len(jobs), "tokens": tokens, "lengths": lengths, "batch_tokens": args.batch_tokens,
            "writer_threads": args.writer_threads,
            "bare_tokens_per_s": round(tokens / bare, 1),
            "pipeline_tokens_per_s": round(tokens / piped, 1),
            "pipeline_vs_bare": round(bare / piped, 3),
            "bytes_written": written, "write_mb_per_s": round(written / piped / 1e6, 1),
        }
        if args.url:
            report["http_tokens_per_s"] = round(tokens / http_seconds(args.url, jobs, args.concurrency), 1)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
