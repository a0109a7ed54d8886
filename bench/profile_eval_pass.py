"""Where an evaluation pass's time goes: the batched speculative decode of ``speculative_batch`` at SmolLM2-135M's
shape (random weights: timing only, no acceptance), beside plain HF ``generate`` of the same rows as the baseline.

The ShareGPT benchmark's evaluation decodes every prompt 15 times (bench/RESULTS.md, 2026-12-04: 9 min 58 s, the
longest stage); its time grew with the sets' context lengths, not their prompt counts. This script times one decode
per proposer kind over a batch of prompts of a given length, times the one-pass curve (k = 1..7) over the same rows'
replies for each proposer kind, then profiles a short decode (--profile: whose) with torch.profiler, so the change
that follows is chosen from a measurement.

    python bench/profile_eval_pass.py --device cuda --rows 256 --prompt-len 1200 --new 64 --dtype float32 --json out.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluation.lookup import LookupProposer, NoProposer  # noqa: E402
from evaluation.one_pass import Replay, one_pass_counts  # noqa: E402
from evaluation.speculative_batch import (  # noqa: E402
    RowProposers,
    drafter_proposer,
    prefill_batch,
    speculative_generate_batch,
)
from evaluation.verify_attention import use_grouped_attention  # noqa: E402
from modeling.attention import avoid_cudnn_attention  # noqa: E402
from modeling.methods import new_drafter  # noqa: E402
from modeling.padding import left_pad  # noqa: E402
from modeling.dflash import DFlashConfig  # noqa: E402
from modeling.eagle3 import DrafterConfig  # noqa: E402
from shared import eagle3  # noqa: E402

log = logging.getLogger("profile_eval_pass")

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
LAYERS = eagle3.default_layer_ids(SMOLLM2["num_hidden_layers"])  # what extraction reads by default
CURVE = 7  # the k of a run's curve (evaluate.curve_max_steps)
BATCH_TOKENS = 131072  # evaluate.batch_tokens' default


def build_target(device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2, attn_implementation="sdpa")).to(device, dtype).eval()
    target.generation_config.eos_token_id = None  # random weights: no row stops early
    target.generation_config.pad_token_id = 0
    return target


def build_drafter(kind: str, target: Any, device: torch.device, dtype: torch.dtype) -> Any:
    base = DrafterConfig.from_target_config(target.config.to_dict(), draft_vocab_size=32000, layer_ids=LAYERS)
    config = base if kind == "eagle3" else DFlashConfig(base=base, num_layers=2, block_size=8, mask_token_id=49148)
    drafter = new_drafter(config)
    drafter.load_embedding(target.get_input_embeddings().weight.detach().float().cpu())
    return drafter.to(device, dtype).eval()


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1200)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--profile-new", type=int, default=8, help="tokens of the profiled decode")
    parser.add_argument("--profile", default="none", choices=("none", "lookup", "eagle3", "dflash"),
                        help="which proposer's decode the profiler records")
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "grouped"),
                        help="the verification passes' attention: transformers' SDPA, or verify_attention's grouped products")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.rows, args.new, args.profile_new) < 1 or args.prompt_len < 2 or args.k < 0:
        parser.error("--rows, --new and --profile-new need at least 1, --prompt-len at least 2, --k at least 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        avoid_cudnn_attention()  # as evaluation's load_target does: cuDNN re-plans for every new key length
    target = build_target(device, dtype)
    gen = torch.Generator().manual_seed(1)
    # Lengths spread around --prompt-len, as a set's prompts are; tokens random.
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len * 3 // 2 + 1, (args.rows,), generator=gen).tolist()
    prompts = [torch.randint(1, 49000, (n,), generator=gen).tolist() for n in lengths]
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                               "dtype": args.dtype, "rows": args.rows, "mean_prompt_len": sum(lengths) / len(lengths),
                               "new_tokens": args.new, "k": args.k, "attention": args.attention, "decodes": {}}

    # The baseline: HF generate over the same left-padded rows, greedy, its own cache, SDPA attention.
    ids, mask = left_pad(prompts, 0, device)
    with torch.inference_mode():
        started = synced(device)
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                        do_sample=False, pad_token_id=0)
        seconds = synced(device) - started
    figures["hf_generate"] = {"s": round(seconds, 3), "ms_per_token_step": round(1000 * seconds / args.new, 2)}
    log.info("HF generate: %.2f s, %.1f ms a step", seconds, 1000 * seconds / args.new)

    if args.attention == "grouped":
        use_grouped_attention(target)
    started = synced(device)
    pre = prefill_batch(target, prompts, LAYERS)
    figures["prefill_s"] = round(synced(device) - started, 3)

    plans = {
        "none": (lambda: RowProposers([NoProposer() for _ in prompts]), 0),
        "lookup": (lambda: RowProposers([LookupProposer(p[0], min_n=1, max_n=3) for p in prompts]), args.k),
        "eagle3": (lambda: drafter_proposer(build_drafter("eagle3", target, device, dtype)), args.k),
        "dflash": (lambda: drafter_proposer(build_drafter("dflash", target, device, dtype)), args.k),
    }
    replies: list[list[int]] = []
    for name, (proposer, k) in plans.items():
        made = proposer()
        started = synced(device)
        results = speculative_generate_batch(target, made, prompts, max_new_tokens=args.new, draft_steps=k,
                                             layer_ids=LAYERS, prefill=pre)
        seconds = synced(device) - started
        passes = max(len(r.accepted) for r in results)
        figures["decodes"][name] = {"s": round(seconds, 3), "passes": passes, "ms_per_pass": round(1000 * seconds / passes, 2)}
        log.info("%s: %.2f s, %d passes, %.1f ms a pass", name, seconds, passes, 1000 * seconds / passes)
        replies = replies or [r.tokens for r in results]  # the plain decode's: every proposer's greedy reply

    # The same rows measured in one pass over those replies, every k at once (evaluation.one_pass): what a
    # decode of each k costs against what the whole curve costs this way (a drafter's time includes the target's
    # forward over prompt + reply, which the decodes above share from one prefill; lookup reads tokens only).
    replays = [Replay(p, r) for p, r in zip(prompts, replies)]
    ks = list(range(1, CURVE + 1))
    figures["one_pass"] = {"k": ks}
    for name, drafters, lookup in (("lookup", {}, (1, 3)),
                                   ("eagle3", {"eagle3": build_drafter("eagle3", target, device, dtype)}, None),
                                   ("dflash", {"dflash": build_drafter("dflash", target, device, dtype)}, None)):
        started = synced(device)
        one_pass_counts(target, replays, drafters, ks, batch_tokens=BATCH_TOKENS, lookup=lookup)
        seconds = synced(device) - started
        figures["one_pass"][name] = {"s": round(seconds, 3)}
        log.info("one pass, %s, k = 1..%d: %.2f s", name, CURVE, seconds)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    proposer, k = plans[args.profile]
    made = proposer()
    with torch.profiler.profile(activities=activities) as prof:
        speculative_generate_batch(target, made, prompts, max_new_tokens=args.profile_new, draft_steps=k,
                                   layer_ids=LAYERS, prefill=pre)
        synced(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60)
    print(table)
    figures["profile_top"] = table
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "profile_top"}, indent=2))


if __name__ == "__main__":
    main()
