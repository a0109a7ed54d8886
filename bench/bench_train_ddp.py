"""Drafter training throughput on 1 and N processes (DDP), through the trainer's own ``train_drafter``.

    python bench/bench_train_ddp.py --work /tmp/bench-ddp --procs 1,2 --batch-sizes 4 --steps 20 --out results.json
    python bench/bench_train_ddp.py --work /tmp/bench-ddp --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 \
        --vocab 1024 --draft-vocab 256 --length 128 --steps 5 --warmup 1      # tiny, on the CPU (gloo)

Builds everything on the machine it runs on, nothing is downloaded:

- a target directory shaped like Llama-3.1-8B by default: its ``config.json`` (32 layers, hidden 4096,
  vocabulary 128,256) and a ``model.safetensors`` holding only ``embed_tokens`` and ``lm_head``, random
  bf16. The trainer reads nothing else of a target (``target_head.py``); the config's 32 layers make the
  default auxiliary layers [1, 15, 28] that the files record and the trainer checks;
- a pool of hidden-state files written by the inference server's own writer code (``write_sample``, atomic)
  at the run layout's paths: random bf16 states, token ids drawn from a skewed
  (Zipf-like) distribution so the draft vocabulary mapping means something, and a loss mask of zeros over a
  "prompt" of 10-50 % of the sample, then ones over the "reply";
- for every (batch size, process count) one run (``RunSpec``, one epoch) whose hidden-state files are hard
  links to the first ``steps x batch x procs`` pool files, so every configuration takes exactly ``steps``
  optimizer steps on distinct samples.

Each run is ``python -m torch.distributed.run --standalone --nproc-per-node N`` (as the train job starts
it) over this file's ``rank`` command, which does what ``services.trainer.distributed.train_rank`` does
(device of LOCAL_RANK, NCCL or gloo process group, ``train_drafter``) except reporting progress to Redis:
rank 0's progress callback records when each step ended instead. The first ``--warmup`` steps are left
out of the timing; the final checkpoint comes after the last timed step. With several processes, the
ranks then time NCCL all-reduces of a gradient-sized float32 buffer and of the per-step loss-sum tensor.

Prints one JSON line per configuration and writes all of them to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script (torchrun runs it by path): the project is importable
    sys.path.insert(0, str(REPO))

from shared import eagle3
from shared.layout import RunPaths
from shared.runspec import EvalConfig, RunSpec, TrainConfig
from shared.settings import configure_logging

log = logging.getLogger("bench_train_ddp")

POOL_RUN = "bench-pool"
POOL_INDEX = "bench_pool.json"  # per-file length and loss-mask count, beside runs/ on the bench volume
MODEL_NAME = "random-llama-3.1-8b-shape"
# NVLink multicast stays off on the lent machines (KINDS.md); set in every rank's environment.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---- setup: target directory and hidden-state files --------------------------------------------

def make_target(model_dir: Path, args: argparse.Namespace, device: torch.device) -> None:
    """config.json of the target's shape and the two (V, H) matrices the trainer reads."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16",
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)
    gen = torch.Generator(device).manual_seed(args.seed)
    weights = {name: (torch.randn(args.vocab, args.hidden, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(weights, str(model_dir / "model.safetensors"))


def writer_target(model_dir: Path) -> object:
    """The target as the hidden-state writer sees it: ``write_sample`` reads its name, fingerprint, dtype
    and the config's hidden size only, so no model or tokenizer is loaded (a stand-in carries the config)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from shared.fingerprint import model_fingerprint
    from services.inference.model import LoadedModel

    return LoadedModel(model=SimpleNamespace(config=AutoConfig.from_pretrained(model_dir)), tokenizer=None, name=MODEL_NAME, fingerprint=model_fingerprint(model_dir),
                       device=torch.device("cpu"), dtype=torch.bfloat16, eos_token_ids=frozenset(), pad_token_id=0,
                       context_length=131072, knows_think_close=False)


def make_pool(data: Path, model_dir: Path, count: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """``count`` hidden-state files at the pool run's paths; returns each one's length and loss-mask count."""
    from services.inference.hidden import HiddenJob, write_sample

    loaded = writer_target(model_dir)
    layer_ids = tuple(eagle3.default_layer_ids(args.layers))
    lengths = [int(n) for n in args.length.split(",")]
    paths = RunPaths(data, POOL_RUN)
    gen = torch.Generator().manual_seed(args.seed)
    dev_gen = torch.Generator(device).manual_seed(args.seed)
    # Zipf-like token frequencies over a shuffled vocabulary: a few thousand ids carry most of the mass.
    weights = 1.0 / (torch.arange(args.vocab, dtype=torch.float64) + 10.0)
    vocab_order = torch.randperm(args.vocab, generator=gen)
    index = []
    for sample_id in range(count):
        length = lengths[sample_id % len(lengths)]
        ids = vocab_order[torch.multinomial(weights, length, replacement=True, generator=gen)]
        prompt = int(length * (0.1 + 0.4 * torch.rand(1, generator=gen).item()))
        mask = [0] * prompt + [1] * (length - prompt)
        aux = torch.randn(length, 3 * args.hidden, generator=dev_gen, device=device, dtype=torch.bfloat16).cpu()
        last = torch.randn(length, args.hidden, generator=dev_gen, device=device, dtype=torch.bfloat16).cpu()
        path = paths.hidden(sample_id)
        job = HiddenJob(ids.tolist(), mask, path, str(path.relative_to(data)), layer_ids)
        write_sample(loaded, job, aux, last)
        index.append({"sample_id": sample_id, "length": length, "loss_tokens": length - prompt})
    return index


def make_run(data: Path, name: str, files: int, batch_size: int, args: argparse.Namespace, attention: str = "auto",
             precision: str = "fp32") -> RunSpec:
    """A run of ``files`` samples (hard links to the pool's first files) that trains one epoch."""
    paths = RunPaths(data, name)
    shutil.rmtree(paths.root, ignore_errors=True)
    pool = RunPaths(data, POOL_RUN)
    for sample_id in range(files):
        target = paths.hidden(sample_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(pool.hidden(sample_id), target)
    train = TrainConfig(epochs=1, batch_size=batch_size, ttt_steps=args.ttt_steps, max_length=max(int(n) for n in args.length.split(",")),
                        draft_vocab_size=args.draft_vocab, save_every=10**9, seed=args.seed, attention=attention,
                        precision=precision)
    spec = RunSpec(name=name, dataset="synthetic", model=MODEL_NAME, rows=files, train_ids=files, train=train,
                   evaluate=EvalConfig(holdout=0))
    spec.save(data)
    return spec


# ---- one rank, under torch.distributed.run -----------------------------------------------------

def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from services.trainer.distributed import rank_device, torchrun_ranks
    from services.trainer.train import TrainProgress, train_drafter

    rank, local_rank = torchrun_ranks()
    configure_logging("INFO" if rank == 0 else "WARNING")
    device = rank_device(args.device, local_rank)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        world = dist.get_world_size()
        spec = RunSpec.load(args.data, args.run)
        ends: list[float] = []
        losses: list[float] = []

        profiler = StepProfiler(args.profile_out, args.profile_from, args.profile_steps) if rank == 0 else None

        def progress(p: TrainProgress) -> None:  # called on rank 0 after each step's loss is on the host
            ends.append(time.perf_counter())
            losses.append(p.loss)
            if profiler is not None:
                profiler.after_step(p.step)

        started = time.perf_counter()
        result = train_drafter(spec, data=args.data, model_dir=args.model_dir, device=str(device), progress=progress)
        finished = time.perf_counter()
        comm = comm_probe(result.drafter, world, device, spec.train.ttt_steps) if world > 1 else {}
        if rank == 0:
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            record = {"world": world, "steps": result.steps, "step_ends": [t - started for t in ends],
                      "losses": losses, "total_s": finished - started, "peak_gib_rank0": peak,
                      "trainable_params": sum(p.numel() for p in result.drafter.trainable_parameters()),
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **comm}
            Path(args.timings).write_text(json.dumps(record), encoding="utf-8")
    finally:
        dist.destroy_process_group()


class StepProfiler:
    """torch.profiler over steps ``first + 1 .. first + steps`` (started after step ``first`` ends), its
    table of operators by GPU time written to ``out``: where a step's time goes."""

    def __init__(self, out: Path | None, first: int, steps: int) -> None:
        self.out, self.first, self.last = out, first, first + steps
        self.profile = None

    def after_step(self, step: int) -> None:
        if self.out is None or not self.last > self.first:
            return
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profile = profile(activities=activities, profile_memory=False, record_shapes=False)
            self.profile.__enter__()
        elif step == self.last and self.profile is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profile.__exit__(None, None, None)
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            table = self.profile.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70)
            self.out.write_text(f"steps {self.first + 1}..{self.last}, totals over all of them\n{table}\n", encoding="utf-8")
            self.profile = None


def flops_per_token(args: argparse.Namespace, length: float) -> float:
    """Training FLOPs per token as the performance issue counts them: 6 x (fc + TTT x (decoder layer + draft
    lm_head)) for the weights' forward and backward, 2 x the target lm_head (forward only), plus attention:
    per TTT step a causal pass over ``length`` keys (QK and PV, forward and backward: 3 x 4 x length/2 x
    heads x head_dim); a chain step's few diagonal keys are left out."""
    h, head_dim = args.hidden, args.hidden // args.heads
    kv = args.kv_heads * head_dim
    layer = 2 * h * (args.heads * head_dim) + 2 * 2 * h * kv + args.heads * head_dim * h + 3 * h * args.intermediate
    weights = 3 * h * h + args.ttt_steps * (layer + h * args.draft_vocab)
    attention = args.ttt_steps * 3 * 4 * (length / 2) * args.heads * head_dim
    return 6 * weights + 2 * args.vocab * h + attention


PEAK_BF16_FLOPS = 790e12  # the performance issue's reference for an H200's dense bf16 rate


def comm_probe(drafter, world: int, device: torch.device, ttt_steps: int) -> dict:
    """Milliseconds per all-reduce of a buffer as large as the gradients (what DDP reduces each step, in
    25 MB buckets overlapped with the backward) and of the per-step loss-sum tensor (float64, 4K+1)."""
    import torch.distributed as dist

    def timed(tensor: torch.Tensor, reps: int) -> float:
        for _ in range(3):
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / reps * 1000

    numel = sum(p.numel() for p in drafter.trainable_parameters())
    grads = torch.zeros(numel, dtype=torch.float32, device=device)
    small = torch.zeros(4 * ttt_steps + 1, dtype=torch.float64, device=device)  # as train_step's global_sum
    return {"allreduce_grad_ms": round(timed(grads, 10), 3), "allreduce_grad_bytes": numel * 4,
            "allreduce_small_ms": round(timed(small, 200), 4)}


# ---- the driver ----------------------------------------------------------------------------------

def run_config(work: Path, spec: RunSpec, procs: int, args: argparse.Namespace) -> dict:
    timings = work / f"timings-{spec.name}.json"
    timings.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", __file__, "rank", spec.name,
               "--data", str(work / "data"), "--model-dir", str(work / "target"),
               "--timings", str(timings), "--device", args.device]
    if args.profile_steps and args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        command += ["--profile-out", str(args.profile_dir / f"profile-{spec.name}.txt"),
                    "--profile-from", str(args.steps - args.profile_steps), "--profile-steps", str(args.profile_steps)]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}  # OMP_NUM_THREADS as the train job leaves it (torchrun sets 1 for N > 1)
    log.info("%s: %s", spec.name, " ".join(command))
    subprocess.run(command, env=env, check=True)
    return json.loads(timings.read_text(encoding="utf-8"))


def summarize(raw: dict, spec: RunSpec, procs: int, index: list[dict], warmup: int, profiled: int = 0) -> dict:
    """Steps and tokens of the steps after warm-up; step i trained the i-th global batch of the epoch's plan
    (``batching.plan_epoch``, which the trainer computes from the same lengths and settings)."""
    from services.trainer.batching import LENGTH, SHUFFLE, plan_epoch

    ends = raw["step_ends"]
    span = spec.train.batch_size * procs
    lengths = [index[i]["length"] for i in range(spec.train_ids)]
    plan = plan_epoch(lengths, seed=spec.train.seed, epoch=0, batch_size=spec.train.batch_size, world=procs,
                      max_tokens=spec.train.max_tokens, batching=LENGTH if spec.train.group_by_length else SHUFFLE)
    timed = range(warmup, len(ends) - profiled)  # profiled steps (the last ones) run slower: not timed
    seconds = ends[timed[-1]] - ends[warmup - 1]
    positions = sum(index[i]["length"] for s in timed for i in plan[s])
    learned = sum(index[i]["loss_tokens"] for s in timed for i in plan[s])
    step_times = [ends[s] - ends[s - 1] for s in timed if s > 0]
    summary = {
        "procs": procs, "batch_per_gpu": spec.train.batch_size, "global_batch": span, "steps": raw["steps"],
        "warmup_steps": warmup, "timed_steps": len(timed), "timed_s": round(seconds, 3),
        "steps_per_s": round(len(timed) / seconds, 4),
        "tokens_per_s": round(positions / seconds, 1), "loss_tokens_per_s": round(learned / seconds, 1),
        "step_s_median": round(statistics.median(step_times), 4) if step_times else None,
        "step_s_max": round(max(step_times), 4) if step_times else None,
        "first_step_s": round(ends[0], 2), "total_s": round(raw["total_s"], 2),
        "loss_first": round(raw["losses"][0], 4), "loss_last": round(raw["losses"][-1], 4),
        "peak_gib_rank0": round(raw["peak_gib_rank0"], 2) if raw["peak_gib_rank0"] is not None else None,
        "attention": spec.train.attention, "precision": spec.train.precision,
        "trainable_params": raw["trainable_params"], "device": raw["device"],
    }
    summary.update({k: raw[k] for k in ("allreduce_grad_ms", "allreduce_grad_bytes", "allreduce_small_ms") if k in raw})
    return summary


def bench_main(args: argparse.Namespace) -> None:
    configure_logging("INFO")
    work, procs_list = args.work, [int(n) for n in args.procs.split(",")]
    batch_sizes = [int(n) for n in args.batch_sizes.split(",")]
    data, model_dir = work / "data", work / "target"
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and torch.cuda.device_count() < max(procs_list):
        raise SystemExit(f"{max(procs_list)} processes need as many GPUs; {torch.cuda.device_count()} visible")
    pool_files = args.steps * max(batch_sizes) * max(procs_list)
    started = time.perf_counter()
    shape = {k: v for k, v in shape_of(args).items() if k not in ("steps", "warmup")}
    saved = json.loads((data / POOL_INDEX).read_text(encoding="utf-8")) if (data / POOL_INDEX).is_file() else {}
    if saved.get("shape") != shape or len(saved.get("files", [])) < pool_files:
        shutil.rmtree(work, ignore_errors=True)
        make_target(model_dir, args, device)
        saved = {"shape": shape, "files": make_pool(data, model_dir, pool_files, args, device)}
        (data / POOL_INDEX).write_text(json.dumps(saved), encoding="utf-8")
    index = saved["files"]
    log.info("setup: %d pool files in %.1f s", pool_files, time.perf_counter() - started)
    results: list[dict] = []
    for batch_size in batch_sizes:
        for procs in procs_list:
            for attention in args.attention.split(","):
                for precision in args.precision.split(","):
                    results.append(one_config(args, work, index, results, batch_size, procs, started, attention, precision))
                    print(json.dumps(results[-1]), flush=True)
            if args.out:  # after every configuration, so a run cut short still leaves what it measured
                args.out.write_text(json.dumps({"shape": shape_of(args), "results": results}, indent=1), encoding="utf-8")


def one_config(args: argparse.Namespace, work: Path, index: list[dict], done: list[dict], batch_size: int, procs: int,
               started: float, attention: str = "auto", precision: str = "fp32") -> dict:
    variant = {"procs": procs, "batch_per_gpu": batch_size, "attention": attention, "precision": precision}
    if args.deadline_s and time.perf_counter() - started > args.deadline_s:
        return {**variant, "skipped": f"past --deadline-s {args.deadline_s}"}
    data = work / "data"
    spec = make_run(data, f"bench-b{batch_size}-p{procs}-{attention}-{precision}", args.steps * batch_size * procs,
                    batch_size, args, attention, precision)
    try:
        summary = summarize(run_config(work, spec, procs, args), spec, procs, index, args.warmup,
                            args.profile_steps if args.profile_dir else 0)
    except subprocess.CalledProcessError as exc:  # out of memory, say: the other configurations still run
        log.error("%s failed: %s", spec.name, exc)
        return {**variant, "error": str(exc)}
    finally:
        shutil.rmtree(RunPaths(data, spec.name).checkpoints_dir, ignore_errors=True)  # GBs each at 8B shape
    length = summary["tokens_per_s"] / summary["steps_per_s"] / spec.train.batch_size / procs  # mean sample length
    summary["flops_per_token"] = round(flops_per_token(args, length))
    if summary["device"] != "cpu":
        summary["mfu"] = round(summary["tokens_per_s"] / procs * summary["flops_per_token"] / PEAK_BF16_FLOPS, 4)
    base = next((r for r in done if r["batch_per_gpu"] == batch_size and r["procs"] == 1 and "tokens_per_s" in r
                 and r.get("attention") == attention and r.get("precision") == precision), None)
    if base is not None and procs > 1:  # global tokens per second, N processes against one
        summary["speedup_vs_1"] = round(summary["tokens_per_s"] / base["tokens_per_s"], 3)
        summary["scaling_efficiency"] = round(summary["speedup_vs_1"] / procs, 3)
    return summary


def shape_of(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "draft_vocab",
                                         "length", "ttt_steps", "seed", "steps", "warmup")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="one rank (started by torch.distributed.run)")
    rank.add_argument("--data", type=Path, required=True)
    rank.add_argument("--model-dir", type=Path, required=True)
    rank.add_argument("run", help="the run to train")  # positional: torchrun's parser would take --run for its --run-path
    rank.add_argument("--timings", type=Path, required=True)
    rank.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    rank.add_argument("--profile-out", type=Path, default=None)
    rank.add_argument("--profile-from", type=int, default=0)
    rank.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-train-ddp"), help="target, files and runs (reused when big enough)")
    parser.add_argument("--procs", default="1,2", help="process counts to compare (one per GPU)")
    parser.add_argument("--batch-sizes", default="4", help="per-GPU batch sizes (train.batch_size)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per configuration, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing (at least 1)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--length", default="2048", help="sample lengths in tokens, round-robin over the files")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--attention", default="auto", help="TTT attention kinds to compare (train.attention): auto,dense,flex")
    parser.add_argument("--precision", default="fp32", help="weights to compare (train.precision): fp32,bf16")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile the last this many steps on rank 0 (left out of the timing; with --profile-dir)")
    parser.add_argument("--profile-dir", type=Path, default=None, help="where the profiles' tables go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write all results here as JSON")
    parser.add_argument("--deadline-s", type=float, default=0, help="start no configuration after this many seconds (0: no limit)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command is None and not 1 <= args.warmup < args.steps - (args.profile_steps if args.profile_dir else 0):
        raise SystemExit("--warmup must be at least 1 and leave timed steps before the profiled ones")
    if args.command == "rank":
        rank_main(args)
    else:
        bench_main(args)


if __name__ == "__main__":
    main()
