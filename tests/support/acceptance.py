"""Acceptance lengths computed independently of evaluation/evaluate.py, to check its reports.

The reference shares nothing with the decoding loop under test but the two models: the target's greedy
reply comes from ``generate``; the drafter's proposals after a prefix are recomputed from scratch (one
target pass over the verified tokens, the drafter over every position with a fresh cache: no cache
reuse, no cropping); prompt lookup's proposals come from a brute-force n-gram search written here; the
accept rule is replayed in plain Python over those lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from modeling.eagle3 import Eagle3Drafter, KVCache


@torch.inference_mode()
def greedy_tokens(target: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt], device=target.device), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def proposals_from_scratch(target: Any, drafter: Eagle3Drafter, sequence: list[int], k: int) -> list[int]:
    """The drafter's ``k`` chained proposals after ``sequence`` (prompt + emitted tokens; the last one is
    the newest, which the target has not read yet)."""
    verified, device = sequence[:-1], drafter.fc.weight.device  # each model on its own device (CPU or CUDA)
    states = target(torch.tensor([verified], device=target.device), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i + 1][0] for i in drafter.config.layer_ids], dim=-1)  # (L, 3Ht), index 0 = embeddings
    hidden = drafter.fuse(aux[None].to(device, drafter.fc.weight.dtype))  # (1, L, H): position p pairs with token p + 1
    tokens, drafts = list(sequence[1:]), []
    for _ in range(k):
        out = drafter(hidden, torch.tensor([tokens], device=device), torch.arange(len(tokens), device=device)[None],
                      KVCache())  # (1, T, H)
        last = out[:, -1:]  # (1, 1, H)
        drafts.append(int(drafter.to_target_ids(drafter.logits(last)[0, -1].argmax())))
        # The next chain step reads this step's output and its token, one position further on.
        hidden, tokens = torch.cat([hidden, last], dim=1), [*tokens, drafts[-1]]
    return drafts


def lookup_from_scratch(sequence: list[int], k: int, *, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by brute force: every n from the longest down, every earlier start from the first."""
    for n in reversed(range(min_n, max_n + 1)):
        if n >= len(sequence):
            continue
        tail = tuple(sequence[-n:])
        starts = [s for s in range(len(sequence) - n) if tuple(sequence[s : s + n]) == tail]
        if starts:
            return sequence[starts[0] + n : starts[0] + n + k]
    return []


def accepted_per_step(target: Any, drafter: Eagle3Drafter | None, prompt: list[int], *, draft_steps: int,
                      max_new_tokens: int, lookup: tuple[int, int] | None = None) -> list[int]:
    """Tokens each verification step emits: the drafts that match the target's greedy reply in a row,
    plus one (the target's own token), cut at the reply's end. Drafts come from the drafter, or with
    ``lookup`` = (min_n, max_n) from prompt lookup."""
    reply = greedy_tokens(target, prompt, max_new_tokens)
    emitted, accepted = reply[:1], []  # the prefill yields the first token
    while len(emitted) < len(reply):
        if lookup is not None:
            drafts = lookup_from_scratch(prompt + emitted, draft_steps, min_n=lookup[0], max_n=lookup[1])
        else:
            drafts = proposals_from_scratch(target, drafter, prompt + emitted, draft_steps)
        expected = reply[len(emitted) : len(emitted) + len(drafts)]
        matched = 0
        while matched < len(expected) and drafts[matched] == expected[matched]:
            matched += 1
        step = min(matched + 1, len(reply) - len(emitted))
        emitted += reply[len(emitted) : len(emitted) + step]
        accepted.append(step)
    return accepted


def expected_report(target: Any, tokenizer: Any, drafter: Eagle3Drafter, prompts: list[list[dict]], *,
                    draft_steps: int, max_new_tokens: int) -> tuple[list[list[int]], float]:
    """Per prompt the tokens each step emits, and the mean acceptance length over all steps."""
    rows = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        rows.append(accepted_per_step(target, drafter, list(ids), draft_steps=draft_steps, max_new_tokens=max_new_tokens))
    steps = sum(len(row) for row in rows)
    return rows, (sum(sum(row) for row in rows) / steps if steps else 0.0)


def expected_report_of_run(model_dir: Path, export_dir: Path, eval_prompts: Path, *, draft_steps: int,
                           max_new_tokens: int) -> tuple[list[list[int]], float]:
    """The same for a finished run: its exported drafter on its held-out prompts, on the CPU in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modeling.export import load_drafter

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    drafter = load_drafter(export_dir, model_dir, embed=target.get_input_embeddings().weight.detach().float()).eval()
    prompts = [json.loads(line)["messages"] for line in eval_prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    return expected_report(target, tokenizer, drafter, prompts, draft_steps=draft_steps, max_new_tokens=max_new_tokens)


def assert_report_matches(report: dict, expected: tuple[list[list[int]], float]) -> None:
    rows, acceptance = expected
    reported = [row["accepted"] for row in report["prompts"]]
    assert reported == rows, f"tokens per step: reported {reported}, recomputed {rows}"
    assert report["acceptance_length"] == acceptance
