"""Where a decode step's time goes on a small target: the built-in server's batch decoder against plain
Hugging Face ``generate`` on the same batch, plus a torch.profiler table of our steps.

    python bench/profile_decode.py [--model-dir DIR] [--batches 64,256] [--new-tokens 128] [--json OUT]

Without ``--model-dir`` the target is random with SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads,
vocabulary 49,152, tied embeddings): speed depends on shapes, not on what the weights say. No row stops
early (no end-of-sequence token is known), so every row decodes exactly ``--new-tokens`` tokens.
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

from modeling.padding import left_pad  # noqa: E402
from services.inference.decode import GenerationRequest, generate_batch  # noqa: E402
from services.inference.model import LoadedModel  # noqa: E402
from evaluation.speculative import cache_kwarg, crop_cache  # noqa: E402
from shared.settings import configure_logging  # noqa: E402

log = logging.getLogger("profile_decode")


def smollm2_shaped(device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    if args.model_dir is None:
        return smollm2_shaped(device, dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()


def prompts(batch: int, vocab: int, low: int, high: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(low, high + 1, (batch,), generator=gen).tolist()
    return [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in lengths]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ours(loaded: LoadedModel, batch: list[list[int]], new_tokens: int) -> float:
    requests = [GenerationRequest(p, new_tokens) for p in batch]
    sync(loaded.device)
    started = time.perf_counter()
    results = generate_batch(loaded, requests)
    sync(loaded.device)
    assert all(len(r.token_ids) == new_tokens for r in results)
    return time.perf_counter() - started


@torch.inference_mode()
def time_hf(model: Any, batch: list[list[int]], new_tokens: int, device: torch.device, **extra: Any) -> float:
    ids, mask = left_pad(batch, 0, device)
    sync(device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=0, **extra)
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - started


@torch.inference_mode()
def time_passes(model: Any, device: torch.device, rows: int, width: int, context: int, repeats: int = 20) -> float:
    """Seconds per forward of ``rows`` x ``width`` new tokens after ``context`` cached ones, with every hidden
    state kept: what one verification pass of speculative decoding costs."""
    from transformers import DynamicCache

    cache, keyword = DynamicCache(), cache_kwarg(model)
    ids = torch.randint(100, 1000, (rows, context), device=device)
    model(ids, use_cache=True, **{keyword: cache})
    block = torch.randint(100, 1000, (rows, width), device=device)
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        model(block, use_cache=True, output_hidden_states=True, **{keyword: cache})
        sync(device)
        times.append(time.perf_counter() - started)
        crop_cache(cache, context)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def forward_loop(model: Any, batch: list[list[int]], new_tokens: int, device: torch.device, *, keyword: str,
                 cache_position: bool, mask: bool, sync_every: int) -> float:
    """The decoder's forward calls alone (argmax, no sampling or bookkeeping), one knob changed at a time."""
    from transformers import DynamicCache

    ids, attn = left_pad(batch, 0, device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    sync(device)
    started = time.perf_counter()
    out = model(input_ids=ids, attention_mask=attn if mask else None, position_ids=positions, use_cache=True,
                logits_to_keep=1, **{keyword: cache})
    next_pos, width = attn.sum(-1), ids.shape[1]
    for step in range(new_tokens - 1):
        tokens = out.logits[:, -1].float().argmax(-1)
        if step % sync_every == 0:
            tokens.tolist()
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
        extra = {"cache_position": torch.tensor([width + step], device=device)} if cache_position else {}
        out = model(input_ids=tokens[:, None], attention_mask=attn if mask else None, position_ids=next_pos[:, None],
                    use_cache=True, **{keyword: cache}, **extra)
        next_pos = next_pos + 1
    sync(device)
    return time.perf_counter() - started


def variants(model: Any, loaded: LoadedModel, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    """ms per step of each variant on the same batch."""
    device, ms = loaded.device, {}
    runs = {
        "ours": lambda: time_ours(loaded, batch, new_tokens),
        "hf_generate": lambda: time_hf(model, batch, new_tokens, device),
        "loop_cache_kw": lambda: forward_loop(model, batch, new_tokens, device, keyword="cache", cache_position=False,
                                              mask=True, sync_every=1),
        "loop_past_key_values_kw": lambda: forward_loop(model, batch, new_tokens, device, keyword="past_key_values",
                                                        cache_position=False, mask=True, sync_every=1),
        "loop_cache_position": lambda: forward_loop(model, batch, new_tokens, device, keyword="cache",
                                                    cache_position=True, mask=True, sync_every=1),
        "loop_no_mask": lambda: forward_loop(model, batch, new_tokens, device, keyword="cache", cache_position=False,
                                             mask=False, sync_every=1),
        "loop_sync_every_16": lambda: forward_loop(model, batch, new_tokens, device, keyword="cache",
                                                   cache_position=False, mask=True, sync_every=16),
    }
    def without_cudnn() -> float:
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            return time_ours(loaded, batch, new_tokens)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)

    runs["ours_without_cudnn_sdpa"] = without_cudnn
    for name, run in runs.items():
        try:
            ms[name] = 1000 * run() / new_tokens
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
            ms[name] = f"{type(exc).__name__}: {exc}"
        log.info("variant %s: %s ms/step", name, ms[name])
    return ms


def cold_lengths(loaded: LoadedModel, batch_size: int, new_tokens: int, low: int, high: int) -> dict[str, float]:
    """ms per step with cuDNN attention on and off, each first on lengths no earlier decode met (a longest
    prompt of its own), then again on the same lengths."""
    ms, vocab = {}, int(loaded.model.config.vocab_size)
    for offset, cudnn in ((40, True), (80, False)):
        batch = prompts(batch_size, vocab, low, high + offset)
        batch[0] = batch[0][:1] * (high + offset)  # the longest prompt sets every step's key length
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        try:
            for when in ("new_lengths", "same_lengths_again"):
                ms[f"cudnn_{'on' if cudnn else 'off'}_{when}"] = 1000 * time_ours(loaded, batch, new_tokens) / new_tokens
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    log.info("cuDNN attention, new and repeated lengths (ms/step): %s", ms)
    return ms


def profile_ours(loaded: LoadedModel, batch: list[list[int]], steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if loaded.device.type == "cuda" else [])
    requests = [GenerationRequest(p, steps) for p in batch]
    with profile(activities=activities) as prof:
        generate_batch(loaded, requests)
    sort = "self_cuda_time_total" if loaded.device.type == "cuda" else "self_cpu_time_total"
    return (prof.key_averages().table(sort_by="cpu_time_total", row_limit=25) + "\n"
            + prof.key_averages().table(sort_by=sort, row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-lengths", default="60,300")
    parser.add_argument("--pass-rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 164])
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="also HF generate with a static cache and torch.compile")
    parser.add_argument("--variants", type=int, default=0, help="batch size of the one-knob-at-a-time variants")
    parser.add_argument("--cold-check", type=int, default=0,
                        help="batch size of the cuDNN on/off check on new lengths; only that runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configure_logging()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = load(args, device, dtype)
    loaded = LoadedModel(model=model, tokenizer=None, name="profiled", fingerprint="", device=device, dtype=dtype,
                         eos_token_ids=frozenset(), pad_token_id=0, context_length=8192, knows_think_close=False)
    low, high = (int(x) for x in args.prompt_lengths.split(","))
    vocab = int(model.config.vocab_size)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                               "dtype": args.dtype, "new_tokens": args.new_tokens, "prompt_lengths": [low, high],
                               "torch": torch.__version__, "decode": []}
    time_ours(loaded, prompts(4, vocab, low, high), 8)  # warm-up: kernels, allocator
    for b in (int(x) for x in args.batches.split(",")):
        batch = prompts(b, vocab, low, high)
        row = {"batch": b, "ours_s": time_ours(loaded, batch, args.new_tokens),
               "hf_generate_s": time_hf(model, batch, args.new_tokens, device)}
        for key in ("ours", "hf_generate"):
            row[f"{key}_ms_per_step"] = 1000 * row[f"{key}_s"] / args.new_tokens
            row[f"{key}_tokens_per_s"] = b * args.new_tokens / row[f"{key}_s"]
        log.info("batch %d: %s", b, json.dumps(row))
        results["decode"].append(row)
    if args.cold_check:
        results["cold_lengths_ms_per_step"] = cold_lengths(loaded, args.cold_check, args.new_tokens, low, high)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    if args.variants:
        results["variants_ms_per_step"] = variants(model, loaded, prompts(args.variants, vocab, low, high),
                                                   args.new_tokens)
        log.info("attention implementation: %s", model.config._attn_implementation)
    results["passes_ms"] = {f"{rows}x{width}": 1000 * time_passes(model, device, rows, width, 300)
                            for rows in args.pass_rows for width in (1, 4, 8)}
    log.info("verification passes (ms, median): %s", results["passes_ms"])
    table = profile_ours(loaded, prompts(max(int(x) for x in args.batches.split(",")), vocab, low, high),
                         args.profile_steps)
    print(table)
    results["profile"] = table
    if args.compile:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
        for b in (int(x) for x in args.batches.split(",")):
            batch = prompts(b, vocab, low, high)
            first = time_hf(model, batch, args.new_tokens, device)
            second = time_hf(model, batch, args.new_tokens, device)
            row = {"batch": b, "compile_first_s": first, "compiled_s": second,
                   "compiled_ms_per_step": 1000 * second / args.new_tokens}
            log.info("compiled, batch %d: %s", b, json.dumps(row))
            results.setdefault("compiled", []).append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
