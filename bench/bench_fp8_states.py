"""fp8 hidden states: which scaling reconstructs a real target's states best, and what files really cost.

On one real target (SmolLM2-135M-Instruct unless ``--model-dir`` names another), in float32 on the CPU:

- one long sample (the repository's own README and benchmark notes, ``--tokens`` long) and ``--short``
  chat prompts from the shipped demo prompts, each run through the server's own ``forward_hidden``;
- each state (low, mid, high auxiliary layers, last) rounded to bf16, then to e4m3 with one scale per
  token (the production ``quantize_fp8``), one per channel over the sample, or one per tensor; errors are
  against the float32 states: relative (Frobenius) error, the worst token's relative error, and for
  the last state how often the target's ``lm_head`` keeps its top token and the KL to its distribution;
- the long sample written by the server's own ``write_sample`` in bf16 and in fp8, verified, and its
  bytes per token against the states' own size (hidden × 4 states × 1 or 2 bytes) and against 8 × hidden.

    python bench/bench_fp8_states.py --tokens 2048 --short 8 --json /tmp/fp8.json

Relative errors are reported three ways: over the whole state (dominated by the few massive activations
of attention-sink tokens), each token's own (median and worst): the drafter normalizes each token's
fused state, so a token's own error is the one it feels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from modeling.fp8 import quantize_fp8  # noqa: E402
from services.inference.hidden import HiddenJob, forward_hidden, write_sample  # noqa: E402
from services.inference.model import LoadedModel, load_model  # noqa: E402
from shared import eagle3  # noqa: E402
from shared.hidden_file import verify_hidden_file  # noqa: E402
from shared.settings import InferenceSettings, configure_logging  # noqa: E402

log = logging.getLogger("bench_fp8_states")
LAYER_NAMES = ("low", "mid", "high", "last")
TEXT_FILES = ("README.md", "bench/RESULTS.md")
SCALE_BYTES = 2  # bf16 scales, in every scheme, so only their number differs


def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` through e4m3 with ``scale`` (broadcast), back in float32."""
    q = (x / scale).clamp(-eagle3.FP8_MAX, eagle3.FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def bf16_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax / eagle3.FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).bfloat16().float()


def per_token(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_fp8(x, 1)  # the writer's own code: one layer at a time here
    return q.float() * scale.float()


def per_channel(x: torch.Tensor) -> torch.Tensor:
    return rounded(x.float(), bf16_scale(x.float().abs().amax(dim=0, keepdim=True)))


def per_tensor(x: torch.Tensor) -> torch.Tensor:
    return rounded(x.float(), bf16_scale(x.float().abs().amax()))


# scheme -> (reconstruction of a bf16 (L, H) state, scale values per token given L tokens and H channels)
SCHEMES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int, int], float]]] = {
    "bf16": (lambda x: x.float(), lambda length, hidden: 0.0),
    "fp8_per_token": (per_token, lambda length, hidden: 1.0),
    "fp8_per_channel": (per_channel, lambda length, hidden: hidden / length),
    "fp8_per_tensor": (per_tensor, lambda length, hidden: 1.0 / length),
}


def samples(loaded: LoadedModel, tokens: int, short: int) -> list[list[int]]:
    text = "\n\n".join((REPO / name).read_text(encoding="utf-8") for name in TEXT_FILES)
    long = loaded.tokenizer(text)["input_ids"][:tokens]
    rows = [json.loads(line) for line in (REPO / "shared/data/demo_prompts.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if "prompt" in r][:short]
    chats = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"] for p in prompts]
    return [list(long), *[list(c) for c in chats]]


def states_of(loaded: LoadedModel, ids: list[int]) -> list[torch.Tensor]:
    """The four stored states (L, H) each, in float32, of one sample."""
    job = HiddenJob(ids, [1] * len(ids), Path("unused"), "unused", tuple(loaded.default_layer_ids()))
    with torch.inference_mode():
        aux, last = forward_hidden(loaded, [job])
    return [*aux[0].float().chunk(3, dim=-1), last[0].float()]


def errors(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    token = (y - x).norm(dim=-1) / x.norm(dim=-1)  # (L,) each token's own relative error
    return {"rel": ((y - x).norm() / x.norm()).item(), "median_token_rel": token.median().item(),
            "worst_token_rel": token.max().item()}


def head_agreement(lm_head: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    ref, got = (x @ lm_head.T).log_softmax(-1), (y @ lm_head.T).log_softmax(-1)  # (L, V)
    kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="batchmean").item()
    return {"top1_kept": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(), "kl": kl}


def measure(loaded: LoadedModel, batch: list[list[int]]) -> dict[str, dict]:
    """Per scheme: each layer's errors on the long sample, and averaged over the short ones."""
    lm_head = loaded.model.lm_head.weight.detach().float()
    found: dict[str, dict] = {}
    for index, ids in enumerate(batch):
        states = states_of(loaded, ids)
        for scheme, (rebuild, scales) in SCHEMES.items():
            row = {name: errors(x, rebuild(x.bfloat16())) for name, x in zip(LAYER_NAMES, states)}
            with torch.no_grad():
                row["lm_head"] = head_agreement(lm_head, states[-1], rebuild(states[-1].bfloat16()))
            row["scale_bytes_per_token"] = 4 * SCALE_BYTES * scales(len(ids), loaded.hidden_size)
            found.setdefault(scheme, []).append(row)
        log.info("sample %d (%d tokens) measured", index, len(ids))
    return {scheme: {"long": rows[0], "short_mean": mean_rows(rows[1:])} for scheme, rows in found.items()}


def mean_rows(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k != "scale_bytes_per_token"]
    out = {k: {m: sum(r[k][m] for r in rows) / len(rows) for m in rows[0][k]} for k in keys}
    out["scale_bytes_per_token"] = sum(r["scale_bytes_per_token"] for r in rows) / len(rows)
    return out


def file_sizes(loaded: LoadedModel, ids: list[int], directory: Path) -> dict[str, dict]:
    """The long sample through ``write_sample`` from bf16 states, in both storages, each file verified."""
    bf16 = dataclasses.replace(loaded, dtype=torch.bfloat16)  # what a GPU server computes in
    low, mid, high, last = (s.bfloat16() for s in states_of(loaded, ids))
    aux, hidden = torch.cat([low, mid, high], dim=-1), loaded.hidden_size
    sizes = {}
    for storage, width in (("target", 2), ("fp8", 1)):
        job = HiddenJob(ids, [1] * len(ids), directory / f"{storage}.safetensors", f"{storage}.safetensors",
                        tuple(loaded.default_layer_ids()), storage=storage)
        started = time.perf_counter()
        written = write_sample(bf16, job, aux, last)
        seconds = time.perf_counter() - started
        verify_hidden_file(job.path, hidden_size=hidden, sha256=written.sha256)
        per_token = written.bytes / len(ids)
        sizes[storage] = {"dtype": written.dtype, "bytes": written.bytes, "bytes_per_token": per_token,
                          "vs_states_own_size": per_token / (4 * hidden * width),
                          "vs_8h": per_token / (8 * hidden), "write_s": seconds}
    return sizes


def quantize_rate(hidden: int, tokens: int) -> float:
    """Values per second ``quantize_fp8`` turns into e4m3 on this CPU (bf16 in, one sample's aux)."""
    aux = torch.randn(tokens, 3 * hidden).bfloat16()
    started = time.perf_counter()
    quantize_fp8(aux, 3)
    return aux.numel() / (time.perf_counter() - started)


def default_model_dir(root: Path) -> Path:
    from services.cli.target_build import ensure_target

    return ensure_target("smollm2", root / "smollm2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="target directory; default: SmolLM2 converted under --dir")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-fp8")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configure_logging()
    args.dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or default_model_dir(args.dir)
    loaded = load_model(InferenceSettings(model_dir=model_dir, device="cpu", dtype="float32"))
    batch = samples(loaded, args.tokens, args.short)
    result = {"target": model_dir.name, "hidden_size": loaded.hidden_size, "layer_ids": loaded.default_layer_ids(),
              "long_tokens": len(batch[0]), "short_tokens": [len(ids) for ids in batch[1:]],
              "schemes": measure(loaded, batch), "files": file_sizes(loaded, batch[0], args.dir),
              "quantize_values_per_s": quantize_rate(loaded.hidden_size, len(batch[0])),
              "torch_threads": torch.get_num_threads()}
    log.info("%s", json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
