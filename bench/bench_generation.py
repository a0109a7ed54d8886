"""Generation throughput on a workload like a pipeline's: many requests, prompts and replies of mixed lengths.

    python bench/bench_generation.py [--requests 1024] [--slots 256,512,1024] [--baseline-batch 256] [--json OUT]

Compared on the same requests (greedy, bf16, SmolLM2-135M's shape with random weights: speed depends on
shapes, not on what the weights say; no row stops early, so every request decodes exactly its budget):
- ``hf_generate``: plain Hugging Face ``generate``, the requests in arrival order in batches of
  ``--baseline-batch``, each batch decoding until its longest budget (what a script calling ``generate``
  does). Useful tokens only: a row past its own budget counts nothing.
- ``per_batch``: the built-in server's per-batch decoder (``services/inference/decode.py``) on the same batches.
- ``continuous``: the continuous decoder (``services/inference/continuous.py``) at each ``--slots``, every
  request submitted at once, as a generate worker's concurrent requests arrive.
Before timing, a check that the continuous decoder computes what the model computes: its logits against a
full forward in fp32 (max abs difference), and in bf16 the share of requests whose greedy tokens equal HF
``generate``'s (bf16 rounding may flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_decode import prompts, smollm2_shaped  # noqa: E402
from services.inference.continuous import ContinuousScheduler  # noqa: E402
from modeling.attention import avoid_cudnn_attention  # noqa: E402
from modeling.padding import left_pad  # noqa: E402
from services.inference.decode import GenerationRequest, generate_batch  # noqa: E402
from services.inference.model import LoadedModel  # noqa: E402
from services.inference.slots import SlotModel  # noqa: E402
from shared.settings import configure_logging  # noqa: E402

log = logging.getLogger("bench_generation")


def loaded_of(model: Any, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="bench", fingerprint="", device=device, dtype=dtype,
                       eos_token_ids=frozenset(), pad_token_id=0, context_length=8192, knows_think_close=False)


def workload(count: int, vocab: int, prompt_range: tuple[int, int], reply_range: tuple[int, int]) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(7)
    budgets = torch.randint(reply_range[0], reply_range[1] + 1, (count,), generator=gen).tolist()
    return [GenerationRequest(p, n) for p, n in zip(prompts(count, vocab, *prompt_range), budgets)]


@torch.inference_mode()
def run_hf(model: Any, requests: list[GenerationRequest], batch: int, device: torch.device) -> float:
    for start in range(0, len(requests), batch):
        chunk = requests[start: start + batch]
        ids, mask = left_pad([r.prompt_ids for r in chunk], 0, device)
        longest = max(r.max_new_tokens for r in chunk)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                       pad_token_id=0)


def run_per_batch(loaded: LoadedModel, requests: list[GenerationRequest], batch: int) -> None:
    for start in range(0, len(requests), batch):
        generate_batch(loaded, requests[start: start + batch])


def run_continuous(model: SlotModel, requests: list[GenerationRequest], prefill_tokens: int) -> list[list[int]]:
    scheduler = ContinuousScheduler(model, prefill_tokens=prefill_tokens).start()
    try:
        futures = [scheduler.submit(r) for r in requests]
        return [f.result().token_ids for f in futures]
    finally:
        scheduler.stop()


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


class StageClock:
    """Seconds inside the slot model's prefill and decode calls (each synchronised), so the rest of a run's
    time is the scheduler's own host work."""

    def __init__(self, slots: SlotModel) -> None:
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.calls = {"prefill": 0, "decode": 0}
        for name in self.seconds:
            setattr(slots, name, self._wrap(name, getattr(slots, name)))

    def _wrap(self, name: str, call):
        def timed_call(*args):
            started = time.perf_counter()
            out = call(*args)
            torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - started
            self.calls[name] += 1
            return out
        return timed_call


@torch.inference_mode()
def check_logits(device: torch.device) -> float:
    """Max abs difference of slot-decoder logits against a full forward, fp32, 4 requests, 12 steps."""
    model = smollm2_shaped(device, torch.float32)
    loaded = loaded_of(model, device, torch.float32)
    slots = SlotModel(loaded, slots=4, slot_tokens=512, cuda_graphs=True)
    batch = prompts(4, 49152, 40, 200)
    tails = [torch.randint(100, 49152, (12,)).tolist() for _ in batch]
    full = [model(torch.tensor([p + t], device=device)).logits[0] for p, t in zip(batch, tails)]
    worst = (slots.prefill(batch, [0, 1, 2, 3]) - torch.stack([f[len(p) - 1] for f, p in zip(full, batch)])).abs().max()
    for step in range(12):
        positions = [len(p) + step for p in batch]
        logits = slots.decode([t[step] for t in tails], positions)
        expected = torch.stack([f[pos] for f, pos in zip(full, positions)])
        worst = max(worst, (logits - expected).abs().max())
    del slots, model
    torch.cuda.empty_cache()
    return float(worst)


def greedy_agreement(model: Any, loaded: LoadedModel, requests: list[GenerationRequest]) -> float:
    """Share of requests whose continuous greedy tokens equal HF generate's, bf16."""
    slots = SlotModel(loaded, slots=len(requests), slot_tokens=1024)
    ours = run_continuous(slots, requests, 16384)
    same = 0
    with torch.inference_mode():
        for request, tokens in zip(requests, ours):
            out = model.generate(torch.tensor([request.prompt_ids], device=loaded.device), do_sample=False,
                                 max_new_tokens=request.max_new_tokens, min_new_tokens=request.max_new_tokens,
                                 pad_token_id=0)
            same += out[0, len(request.prompt_ids):].tolist() == tokens
    return same / len(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt-lengths", default="60,600")
    parser.add_argument("--reply-lengths", default="32,512")
    parser.add_argument("--slots", default="256,512,1024")
    parser.add_argument("--slot-tokens", type=int, default=2048)
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--baseline-batch", type=int, default=256)
    parser.add_argument("--skip-per-batch", action="store_true")
    parser.add_argument("--sdpa-too", action="store_true",
                        help="also the largest slot count with SDPA attention instead of the per-row kernel")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configure_logging()
    device = torch.device("cuda")
    avoid_cudnn_attention()  # as the server does
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "requests": args.requests, "prompt_lengths": args.prompt_lengths,
                               "reply_lengths": args.reply_lengths}
    results["fp32_max_abs_logit_diff"] = check_logits(device)
    log.info("fp32 slot logits vs full forward: max abs diff %.2e", results["fp32_max_abs_logit_diff"])
    model = smollm2_shaped(device, torch.bfloat16)
    loaded = loaded_of(model, device, torch.bfloat16)
    vocab = int(model.config.vocab_size)
    low, high = (int(x) for x in args.prompt_lengths.split(","))
    rlow, rhigh = (int(x) for x in args.reply_lengths.split(","))
    results["bf16_greedy_equal_share"] = greedy_agreement(model, loaded, workload(16, vocab, (low, high), (16, 64)))
    log.info("bf16 greedy equal to HF generate: %.2f of requests", results["bf16_greedy_equal_share"])
    requests = workload(args.requests, vocab, (low, high), (rlow, rhigh))
    useful = sum(r.max_new_tokens for r in requests)
    results["useful_tokens"] = useful
    run_hf(model, requests[:8], 8, device)  # warm-up
    seconds = timed(lambda: run_hf(model, requests, args.baseline_batch, device))
    results["hf_generate"] = {"seconds": seconds, "tokens_per_s": useful / seconds, "batch": args.baseline_batch}
    log.info("hf_generate: %s", results["hf_generate"])
    if not args.skip_per_batch:
        seconds = timed(lambda: run_per_batch(loaded, requests, args.baseline_batch))
        results["per_batch"] = {"seconds": seconds, "tokens_per_s": useful / seconds, "batch": args.baseline_batch}
        log.info("per_batch: %s", results["per_batch"])
    results["continuous"] = []
    counts = [(int(x), True) for x in args.slots.split(",")]
    if args.sdpa_too:
        counts.append((counts[-1][0], False))
    for count, kernel in counts:
        slots = SlotModel(loaded, slots=count, slot_tokens=args.slot_tokens)
        slots.kernel = slots.kernel and kernel
        warm = timed(lambda: run_continuous(slots, requests, args.prefill_tokens))  # captures its graphs
        seconds = timed(lambda: run_continuous(slots, requests, args.prefill_tokens))
        row = {"slots": count, "attention": "kernel" if slots.kernel else "sdpa", "first_run_s": warm, "seconds": seconds, "tokens_per_s": useful / seconds,
               "graphs": len(slots._graphs)}
        clock = StageClock(slots)  # a third run, timed by stage
        row["staged_run_s"] = timed(lambda: run_continuous(slots, requests, args.prefill_tokens))
        row["stage_seconds"], row["stage_calls"] = clock.seconds, clock.calls
        results["continuous"].append(row)
        log.info("continuous: %s", row)
        del slots
        torch.cuda.empty_cache()
    best = max(results["continuous"], key=lambda r: r["tokens_per_s"])
    results["speedup_vs_hf_generate"] = best["tokens_per_s"] / results["hf_generate"]["tokens_per_s"]
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
