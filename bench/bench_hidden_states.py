"""Hidden-state extraction speed: the endpoint's pipeline against the best plain forward, same tokens.

    python bench/bench_hidden_states.py --model-dir models/tiny --lengths 128,512 --samples 32
    python bench/bench_hidden_states.py --model-dir /tmp/target-8b --lengths 512,1024,1536,2048,3072,4096 --samples 384

Three measurements over the same samples (lengths round-robin, so they arrive mixed, as many
extractors send them):

- "plain": the baseline, the best plain implementation of the work: HF's decoder stack over batches of
  samples of one length each (sorted, no padding and no mask, so SDPA takes its flash kernel), as many
  per batch as the token budget holds; it keeps nothing;
- "padded": the same forward over the groups the pipeline would cut from the queue in arrival order
  (the old measure, for comparison);
- "pipeline": ``HiddenStatePipeline`` (its own grouping, forward with hidden states, copies to host,
  writes with fsync and rename on the writer pool) until every file is on disk.

It also measures the output filesystem's sustained write rate with fsync (``--disk-mb`` written in 64 MB
chunks), and reports which bound applies to the pipeline: the plain forward, or the rate at which that
disk takes the pipeline's bytes. With ``--url`` the samples also go through a running server's
``/v1/hidden_states`` (its data volume must be ``--out``'s filesystem view; paths are sent relative).
Prints one JSON line.
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
    parser.add_argument("--disk-mb", type=int, default=2048, help="MB written to time the disk (0: skip)")
    parser.add_argument("--storage", choices=["target", "fp8"], default="target",
                        help="the files' state storage (extraction.storage): the target's dtype, or fp8 e4m3 + scales")
    return parser.parse_args(argv)


def make_jobs(loaded: LoadedModel, lengths: list[int], count: int, out: Path, seed: int,
              storage: str = "target") -> list[HiddenJob]:
    gen = torch.Generator().manual_seed(seed)
    layer_ids = tuple(loaded.default_layer_ids())
    jobs = []
    for i in range(count):
        length = lengths[i % len(lengths)]
        ids = torch.randint(0, loaded.vocab_size, (length,), generator=gen).tolist()
        rel = RunPaths(out, "bench").hidden_relative(i)  # the server writes only into runs' hidden-state folders
        jobs.append(HiddenJob(ids, [1] * length, out / rel, rel, layer_ids, {"bench": "1"}, storage))
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


def plain_batches(jobs: list[HiddenJob], budget: int) -> list[list[HiddenJob]]:
    """Samples of one length per batch, at most ``budget`` tokens each (one sample if longer)."""
    by_length: dict[int, list[HiddenJob]] = {}
    for job in jobs:
        by_length.setdefault(job.num_tokens, []).append(job)
    batches = []
    for length, same in sorted(by_length.items(), reverse=True):
        per_batch = max(1, budget // length)
        batches += [same[i : i + per_batch] for i in range(0, len(same), per_batch)]
    return batches


def plain_forward_seconds(loaded: LoadedModel, batches: list[list[HiddenJob]]) -> float:
    """HF's forward over equal-length batches, no attention mask: the causal flash path."""
    def run(batch: list[HiddenJob]) -> None:
        ids = torch.tensor([job.input_ids for job in batch], device=loaded.device)
        loaded.model.base_model(input_ids=ids, use_cache=False)

    return timed_forward(loaded, batches, run)


def timed_forward(loaded: LoadedModel, batches: list[list[HiddenJob]], run) -> float:
    """Seconds ``run`` takes over every batch, after one warm-up batch (kernels, allocator)."""
    with torch.inference_mode():
        run(batches[0])
        synchronize(loaded)
        started = time.perf_counter()
        for batch in batches:
            run(batch)
        synchronize(loaded)
    return time.perf_counter() - started


def disk_write_bytes_per_s(directory: Path, megabytes: int) -> float:
    """Sustained write rate of ``directory``'s filesystem: 64 MB chunks, fsync at the end, as ``dd
    conv=fsync`` measures it (the page cache cannot hide a slow disk behind the fsync)."""
    import os

    chunk = os.urandom(64 << 20)
    path = directory / "disk-rate.tmp"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(max(1, megabytes // 64)):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    written = path.stat().st_size
    path.unlink()
    return written / seconds


def synchronize(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


def bare_forward_seconds(loaded: LoadedModel, groups: list[list[HiddenJob]]) -> float:
    """The same forward over right-padded groups with their attention mask."""
    def run(group: list[HiddenJob]) -> None:
        loaded.model.base_model(*right_pad(group, loaded.pad_token_id, loaded.device), use_cache=False)

    return timed_forward(loaded, groups, run)


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
    jobs = make_jobs(loaded, lengths, args.samples, out, args.seed, args.storage)
    tokens = sum(job.num_tokens for job in jobs)
    try:
        plain = plain_forward_seconds(loaded, plain_batches(jobs, args.batch_tokens))
        bare = bare_forward_seconds(loaded, plan_groups(jobs, args.batch_tokens))
        piped, written = pipeline_seconds(loaded, jobs, args)
        forward_rate, piped_rate = tokens / plain, tokens / piped
        bytes_per_token = written / tokens
        report = {
            "model": loaded.name, "device": str(loaded.device), "dtype": loaded.dtype_name,
            "samples": len(jobs), "tokens": tokens, "lengths": lengths, "batch_tokens": args.batch_tokens,
            "writer_threads": args.writer_threads, "storage": args.storage,
            "forward_tokens_per_s": round(forward_rate, 1),  # the baseline: plain, length-sorted, unpadded
            "padded_forward_tokens_per_s": round(tokens / bare, 1),
            "extraction_tokens_per_s": round(piped_rate, 1),
            "extraction_vs_forward": round(piped_rate / forward_rate, 3),
            "bytes_written": written, "write_mb_per_s": round(written / piped / 1e6, 1),
            # bytes per token against the states' own size: 4 states (3 auxiliary + last) of hidden × itemsize
            "disk_bytes_per_token_vs_8h": round(bytes_per_token / (4 * loaded.hidden_size * loaded.dtype.itemsize), 4),
        }
        if args.disk_mb:
            disk_rate = disk_write_bytes_per_s(out, args.disk_mb)
            disk_bound = disk_rate / bytes_per_token  # tokens/s the disk takes at this file size
            report.update({"disk_write_bytes_per_s": round(disk_rate), "disk_bound_tokens_per_s": round(disk_bound, 1),
                           "bound": "disk" if disk_bound < forward_rate else "forward",
                           "extraction_vs_bound": round(piped_rate / min(disk_bound, forward_rate), 3)})
        if args.url:
            report["http_tokens_per_s"] = round(tokens / http_seconds(args.url, jobs, args.concurrency), 1)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
