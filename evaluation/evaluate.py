"""Acceptance length: greedy chain speculative decoding against the target, with baselines and checks.

The target is the real Hugging Face model with a KV cache. Per verification pass a proposer offers up
to k tokens in a chain, the target checks them in one forward pass, and the output is the target's own
greedy decoding, token for token; only the number of target passes changes. Every prompt of a set is
decoded together (``speculative_batch``), one decode per method and k.

Acceptance length = tokens emitted by verification passes / verification passes, summed over every
prompt of a set (a ratio of sums, not a mean of per-prompt ratios); the prompt's prefill pass and the
first token it yields count in neither. Per set it is measured, on the same prompts in the same run:

- ``drafter``: the EAGLE-3 drafter at k = 1 .. ``curve_max_steps`` (the curve) and at ``draft_steps``
  (the headline the status page, exporter and demo show);
- ``lookup``: prompt lookup (n-gram) drafting, vLLM's ``ngram`` method, at the same k;
- ``no_drafter``: plain greedy decoding through the same loop, 1.0 by construction, measured anyway.

By default every k is a real decode (``evaluate.decode = "curve"``); with ``"headline"`` only ``draft_steps``
is, and the curve's other k come from the one-pass curve below (each method's ``measured_by`` names which k
were decoded), so a large target's evaluation costs one decode per method instead of one per k. Each decode is
compared with the target's ``generate(do_sample=False)``
output, computed once per prompt; the report counts the decodes checked and matched per set, and
``verify_greedy_equality`` turns any mismatch into a SpeculativeMismatch once the report is written.

Beside each decoded curve the report carries the same curve computed in one pass over the greedy replies
(``one_pass``: equal to decoding but for rounding) and the largest difference between the two, so the cheap
form that sweeps of many drafters use is checked against real decoding on every evaluation's prompts.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.chat_turns import find_turn_end
from shared.errors import SpeculativeMismatch
from runtime.remote_code import load_from_target
from shared.runspec import EvalConfig
from evaluation.evalsets import EvalPrompt, EvalSet
from evaluation.lookup import LookupProposer, NoProposer
from evaluation.margin import paired_difference
from evaluation.one_pass import Replay, one_pass_counts
from modeling.methods import EAGLE3, method_of
from modeling.eagle3 import TargetTied
from evaluation.speculative import DecodeResult, Tally, eos_ids_of
from modeling.attention import avoid_cudnn_attention
from modeling.padding import left_pad
from evaluation.verify_attention import use_grouped_attention
from evaluation.speculative_batch import (
    drafter_proposer,
    RowProposers,
    pad_id_of,
    prefill_batch,
    speculative_generate_batch,
)

log = logging.getLogger(__name__)


# ---- a run's evaluation --------------------------------------------------------------------------

DRAFTER, LOOKUP, NO_DRAFTER = "drafter", "lookup", "no_drafter"
DEFINITION = ("acceptance length = sum of tokens emitted by target verification passes / number of those passes, "
              "over every prompt of the set; greedy, chain drafting of k tokens per pass; the prompt's prefill pass "
              "and the token it yields count in neither")


@torch.inference_mode()
def greedy_references(target: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy output (``generate``, the prompts as one left-padded batch), which every
    speculative decode must reproduce; each reply ends at its first eos token or at the budget."""
    ids, mask = left_pad(prompts, pad_id_of(target), target.device)
    eos = eos_ids_of(target)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(eos) or None, pad_token_id=pad_id_of(target))
    replies = []
    for row in out[:, ids.shape[1]:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        replies.append(row[:end])  # a row that ended early is padded after its eos
    return replies


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where the two differ (a missing token counts), or None when equal."""
    for position, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return position
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


# Where a speculative decode and ``generate`` part at a position whose two candidate tokens the target scores
# within this many logits of each other, the two paths' rounding (a one-token step against a block of k + 1)
# picked different argmaxes of a near tie: counted and reported as a near tie, not a broken decoder. Any
# real fault (a wrong accept rule, a stale cache) parts at a clear preference and stays a mismatch.
NEAR_TIE_LOGITS = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.25, torch.float16: 0.05}


@dataclass
class SetRun:
    """What one set's decodes add up to while they run."""

    name: str
    tallies: dict[tuple[str, int], Tally] = field(default_factory=dict)
    one_pass: dict[tuple[str, int], Tally] = field(default_factory=dict)  # the same curves, from one_pass
    one_pass_error: str | None = None  # why the one-pass curves are missing (the decoded ones stand)
    rows: list[dict] = field(default_factory=list)
    checked: int = 0
    mismatches: list[dict] = field(default_factory=list)
    near_ties: list[dict] = field(default_factory=list)
    tolerance: float = 0.0  # NEAR_TIE_LOGITS of the target's dtype
    stop_ids: list[int] = field(default_factory=list)  # the tokens a reply ends at (eos and the turn's end)
    seconds: float = 0.0  # spent decoding this set (in parallel shares: the slowest share's)
    too_long: list[dict] = field(default_factory=list)  # prompts left out: longer than prompt_limit

    def fits(self, prompt: EvalPrompt, ids: list[int], limit: int) -> bool:
        """Whether ``prompt`` (``ids``) is at most ``limit`` tokens; a longer one is named in ``too_long``."""
        if len(ids) <= limit:
            return True
        self.too_long.append({"sample_id": prompt.sample_id, "prompt_tokens": len(ids), "limit": limit})
        log.warning("evaluation set %s: prompt %d left out: %d tokens, more than the %d measured",
                    self.name, prompt.sample_id, len(ids), limit)
        return False

    def record(self, prompt: EvalPrompt, method: str, k: int, decoded: DecodeResult, reference: list[int],
               gap: Callable[[int, list[int]], float | None] | None = None) -> None:
        self.tallies.setdefault((method, k), Tally()).add(decoded)
        self.checked += 1
        position = first_difference(decoded.tokens, reference)
        if position is None:
            return
        entry = {"set": self.name, "sample_id": prompt.sample_id, "method": method, "k": k, "position": position}
        logits_apart = None if gap is None else gap(position, decoded.tokens)
        if logits_apart is not None:
            entry["logit_gap"] = logits_apart
        near_tie = logits_apart is not None and logits_apart <= self.tolerance
        (self.near_ties if near_tie else self.mismatches).append(entry)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "checked": self.checked, "mismatches": self.mismatches,
                "near_ties": self.near_ties, "tolerance": self.tolerance, "stop_ids": self.stop_ids, "seconds": self.seconds,
                "too_long": self.too_long, "tallies": [[m, k, t.emitted, t.passes] for (m, k), t in self.tallies.items()],
                "one_pass": [[m, k, t.emitted, t.passes] for (m, k), t in self.one_pass.items()],
                "one_pass_error": self.one_pass_error}

    def merge(self, other: dict[str, Any]) -> None:
        """Add another process's share of the same set (``to_json``'s form)."""
        self.rows += other["rows"]
        self.checked += other["checked"]
        self.mismatches += other["mismatches"]
        self.near_ties += other["near_ties"]
        self.too_long += other["too_long"]
        self.tolerance = max(self.tolerance, other["tolerance"])  # a share with no prompt never set it
        self.stop_ids = self.stop_ids or other["stop_ids"]
        self.seconds = max(self.seconds, other["seconds"])  # the shares ran at the same time
        for mine, theirs in ((self.tallies, other["tallies"]), (self.one_pass, other["one_pass"])):
            for method, k, emitted, passes in theirs:
                mine.setdefault((method, k), Tally()).count(emitted, passes)
        if other["one_pass_error"] and not self.one_pass_error:
            self.fail_one_pass(other["one_pass_error"])

    def fail_one_pass(self, error: str) -> None:
        """No one-pass curve for this set: a part of it could not be measured, and a curve over the other parts
        would set different prompts beside the decoded curve."""
        self.one_pass_error = error
        self.one_pass.clear()


@torch.inference_mode()
def logit_gap(target: Any, prompt_ids: list[int], reference: list[int], position: int, tokens: list[int]) -> float | None:
    """How far apart the target scores the two tokens where a decode left ``reference``: one plain forward
    over the prompt and the shared prefix. None where one output simply has no token there."""
    if position >= len(reference) or position >= len(tokens):
        return None
    logits = target(torch.tensor([prompt_ids + reference[:position]], device=target.device)).logits[0, -1].float()
    return abs(float(logits[reference[position]] - logits[tokens[position]]))


def decode_set(
    target: Any, drafter: TargetTied, prompts: list[list[int]], cfg: EvalConfig, layer_ids: list[int],
    done: Callable[[float], None] | None = None,
) -> dict[tuple[str, int], list[DecodeResult]]:
    """Every decode of these prompts, all prompts together: the drafter and prompt lookup at each k, and no
    drafter (k = 0); ``done`` hears the fraction of the decodes finished."""
    pre = prefill_batch(target, prompts, layer_ids)
    run = functools.partial(speculative_generate_batch, target, prompts=prompts, max_new_tokens=cfg.max_new_tokens,
                            layer_ids=layer_ids, prefill=pre)
    plans: list[tuple[str, int, Callable[[], Any]]] = [
        (DRAFTER, k, lambda: drafter_proposer(drafter)) for k in cfg.decoded_lengths]
    if cfg.baselines:
        plans += [(LOOKUP, k, lambda: RowProposers([LookupProposer(ids[0], min_n=cfg.lookup_min, max_n=cfg.lookup_max)
                                                    for ids in prompts])) for k in cfg.decoded_lengths]
        plans.append((NO_DRAFTER, 0, lambda: RowProposers([NoProposer() for _ in prompts])))
    decodes = {}
    for finished_plans, (method, k, proposer) in enumerate(plans, start=1):
        decodes[(method, k)] = run(proposer(), draft_steps=k)
        if done is not None:
            done(finished_plans / len(plans))
    return decodes


def prompt_row(prompt: EvalPrompt, ids: list[int], decodes: dict[tuple[str, int], DecodeResult], cfg: EvalConfig) -> dict:
    """The headline decode's steps, as before, and every decode's pass and emitted counts (what the margin
    over prompt lookup resamples, per prompt)."""
    head = decodes[(DRAFTER, cfg.draft_steps)]
    passes: dict[str, Any] = {}
    emitted: dict[str, Any] = {}
    for (method, k), decoded in decodes.items():
        if method == NO_DRAFTER:
            passes[method], emitted[method] = decoded.steps, sum(decoded.accepted)
        else:
            passes.setdefault(method, {})[str(k)] = decoded.steps
            emitted.setdefault(method, {})[str(k)] = sum(decoded.accepted)
    return {"sample_id": prompt.sample_id, "prompt_tokens": len(ids), "tokens": len(head.tokens), "steps": head.steps,
            "accepted": head.accepted, "acceptance_length": head.acceptance_length, "passes": passes,
            "emitted": emitted,
            "reply": head.tokens,  # what a serving engine's greedy reply must equal (engine_acceptance)
            "matched": head.matched}  # accepted drafts per pass as vLLM counts them (DecodeResult.matched)


def prompt_ids_of(tokenizer: Any, prompt: EvalPrompt) -> list[int]:
    if prompt.earlier:
        raise ValueError(f"prompt {prompt.sample_id} has turns the target must answer first (answer_earlier_turns)")
    return chat_ids(tokenizer, prompt.messages)


def chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def answer_earlier_turns(target: Any, tokenizer: Any, prompts: list[EvalPrompt], cfg: EvalConfig,
                         measured: SetRun | None = None) -> list[EvalPrompt]:
    """Each prompt with its earlier turns answered by the target, greedily, turn by turn (up to
    ``cfg.earlier_reply_tokens`` a reply; the end-of-turn token closes it), as a plain prompt whose messages
    hold those replies; the replies are decoded in parts of ``cfg.batch_tokens``. With ``measured``, a prompt
    whose earlier turn is longer than ``prompt_limit`` is left out, named there."""
    budget = cfg.earlier_reply_tokens
    limit = prompt_limit(target, cfg)
    conversations: list[list[dict]] = [[] for _ in prompts]
    dropped: set[int] = set()
    for turn in range(max((len(p.earlier) for p in prompts), default=0)):
        asking = [i for i, p in enumerate(prompts) if len(p.earlier) > turn and i not in dropped]
        for i in asking:
            conversations[i] += list(prompts[i].earlier[turn])
        ids = {i: chat_ids(tokenizer, conversations[i]) for i in asking}
        if measured is not None:
            dropped.update(i for i in asking if not measured.fits(prompts[i], ids[i], limit))
            asking = [i for i in asking if i not in dropped]
        asked = [ids[i] for i in asking]
        replies = [reply for part in token_batches(asked, cfg.batch_tokens, budget)
                   for reply in greedy_references(target, asked[part.start: part.stop], budget)]
        for i, reply in zip(asking, replies):
            text = tokenizer.decode(reply, skip_special_tokens=True).strip()
            conversations[i].append({"role": "assistant", "content": text})
    return [EvalPrompt(p.sample_id, conversations[i] + p.messages) if p.earlier else p
            for i, p in enumerate(prompts) if i not in dropped]


def prompt_limit(target: Any, cfg: EvalConfig) -> int:
    """The longest prompt measured: ``max_prompt_tokens``, less where the target's context leaves no room for
    the reply and the drafts proposed past its budget."""
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if not context:
        return cfg.max_prompt_tokens
    return max(1, min(cfg.max_prompt_tokens, context - cfg.max_new_tokens - max(cfg.chain_lengths) - 1))


def measure_prompts(target: Any, tokenizer: Any, drafter: TargetTied, prompts: list[EvalPrompt], cfg: EvalConfig,
                    measured: SetRun, progress: Callable[[int, int], None] | None = None) -> None:
    """Every decode of these prompts, ``cfg.batch_prompts`` at a time, each checked against ``generate``, added
    to ``measured``; ``progress`` hears (prompts done, prompts) as the decodes finish."""
    started = time.monotonic()
    layer_ids = list(drafter.config.layer_ids)
    measured.tolerance = NEAR_TIE_LOGITS.get(target.dtype, 0.0)
    measured.stop_ids = sorted(eos_ids_of(target))
    limit = prompt_limit(target, cfg)
    for start in range(0, len(prompts), cfg.batch_prompts):
        chunk = answer_earlier_turns(target, tokenizer, prompts[start: start + cfg.batch_prompts], cfg, measured)
        every_ids = [prompt_ids_of(tokenizer, p) for p in chunk]
        kept = [i for i, (p, one) in enumerate(zip(chunk, every_ids)) if measured.fits(p, one, limit)]
        chunk, ids = [chunk[i] for i in kept], [every_ids[i] for i in kept]
        span = len(prompts[start: start + cfg.batch_prompts])  # a prompt left out counts as settled
        tick = None if progress is None else (lambda f, s=start, n=span: progress(s + int(f * n), len(prompts)))
        if not chunk:
            if tick is not None:
                tick(1.0)
            continue
        for part in token_batches(ids, cfg.batch_tokens, cfg.max_new_tokens):
            part_tick = None if tick is None else (
                lambda f, a=part.start, n=len(part), m=len(ids): tick((a + f * n) / m))
            decode_part(target, drafter, [chunk[i] for i in part], [ids[i] for i in part], cfg, layer_ids,
                        measured, part_tick)
    measured.seconds += time.monotonic() - started


@torch.inference_mode()
def set_replays(target: Any, tokenizer: Any, prompts: list[EvalPrompt], cfg: EvalConfig) -> list[Replay]:
    """The prompts ``measure_prompts`` measures (earlier turns answered by the target, too long ones left out)
    with the target's greedy reply to each: what ``one_pass`` walks, once for any number of drafters."""
    measured, limit, replays = SetRun("replays"), prompt_limit(target, cfg), []
    for start in range(0, len(prompts), cfg.batch_prompts):
        chunk = answer_earlier_turns(target, tokenizer, prompts[start: start + cfg.batch_prompts], cfg, measured)
        ids = [one for one in (prompt_ids_of(tokenizer, p) for p in chunk) if len(one) <= limit]
        for part in token_batches(ids, cfg.batch_tokens, cfg.max_new_tokens):
            asked = [ids[i] for i in part]
            replays += [Replay(one, reply) for one, reply in zip(asked, greedy_references(target, asked, cfg.max_new_tokens))]
    return replays


def token_batches(ids: list[list[int]], budget: int, reply_tokens: int) -> list[range]:
    """Consecutive index ranges of ``ids`` whose rows times their longest prompt plus the reply budget stay
    within ``budget`` (a range holds one row at least, however long)."""
    parts, start, longest = [], 0, 0
    for i, one in enumerate(ids):
        wider = max(longest, len(one) + reply_tokens)
        if i > start and (i - start + 1) * wider > budget:
            parts.append(range(start, i))
            start, wider = i, len(one) + reply_tokens
        longest = wider
    if ids:
        parts.append(range(start, len(ids)))
    return parts


def decode_part(target: Any, drafter: TargetTied, prompts: list[EvalPrompt], ids: list[list[int]],
                cfg: EvalConfig, layer_ids: list[int], measured: SetRun,
                tick: Callable[[float], None] | None) -> None:
    """One batch's decodes, each checked against ``generate``, added to ``measured``."""
    references = greedy_references(target, ids, cfg.max_new_tokens)
    decodes = decode_set(target, drafter, ids, cfg, layer_ids, tick)
    if measured.one_pass_error is None:
        add_one_pass(target, drafter, ids, references, cfg, measured)
    for row, (prompt, prompt_ids, reference) in enumerate(zip(prompts, ids, references)):
        mine = {key: results[row] for key, results in decodes.items()}
        gap = functools.partial(logit_gap, target, prompt_ids, reference)
        for (method, k), decoded in mine.items():
            measured.record(prompt, method, k, decoded, reference, gap)
        measured.rows.append(prompt_row(prompt, prompt_ids, mine, cfg))


def add_one_pass(target: Any, drafter: TargetTied, ids: list[list[int]], references: list[list[int]], cfg: EvalConfig,
                 measured: SetRun) -> None:
    """The part's one-pass curves, added to ``measured``. They cross-check the decoded curves, which are the
    report's figures: a fault here is logged and named in the report (``one_pass_error``), never fatal to the
    decodes it checks."""
    lookup = (cfg.lookup_min, cfg.lookup_max) if cfg.baselines else None
    try:
        counts = one_pass_counts(target, [Replay(one, reference) for one, reference in zip(ids, references)],
                                 {DRAFTER: drafter}, cfg.chain_lengths, batch_tokens=cfg.batch_tokens, lookup=lookup)
    except Exception as exc:  # noqa: BLE001 - reported in the set's report, beside the decoded figures
        log.exception("evaluation set %s: one-pass curves not measured", measured.name)
        measured.fail_one_pass(f"{type(exc).__name__}: {exc}")
        return
    for method, found in counts.items():
        for k, tally in found.tallies.items():
            measured.one_pass.setdefault((method, k), Tally()).count(tally.emitted, tally.passes)


def evaluate_prompts(
    target: Any, tokenizer: Any, drafter: TargetTied, prompts: list[EvalPrompt], cfg: EvalConfig,
    progress: Callable[[int, int], None] | None = None, *, name: str = "holdout",
) -> dict[str, Any]:
    """One set: every prompt decoded by every method at every k, each decode checked against ``generate``."""
    measured = SetRun(name)
    measure_prompts(target, tokenizer, drafter, prompts, cfg, measured, progress)
    return set_report(measured, cfg, list(drafter.config.layer_ids), method_of(drafter.config))


def set_report(measured: SetRun, cfg: EvalConfig, layer_ids: list[int], drafter_method: str = EAGLE3) -> dict[str, Any]:
    head = measured.tallies.get((DRAFTER, cfg.draft_steps), Tally())
    methods: dict[str, Any] = {}
    for (method, k), t in sorted(measured.tallies.items()):
        if method == NO_DRAFTER:
            methods[method] = {"acceptance_length": t.acceptance_length, "emitted": t.emitted, "passes": t.passes}
        else:
            entry = methods.setdefault(method, {"curve": {}, "emitted": {}, "passes": {}})
            entry["curve"][str(k)], entry["emitted"][str(k)], entry["passes"][str(k)] = t.acceptance_length, t.emitted, t.passes
    if LOOKUP in methods:
        methods[LOOKUP]["ngram"] = {"prompt_lookup_min": cfg.lookup_min, "prompt_lookup_max": cfg.lookup_max}
    apart = 0.0
    for (method, k), t in sorted(measured.one_pass.items()):
        entry = methods[method].setdefault("one_pass", {"curve": {}, "emitted": {}, "passes": {}})
        entry["curve"][str(k)], entry["emitted"][str(k)], entry["passes"][str(k)] = t.acceptance_length, t.emitted, t.passes
        if str(k) in methods[method]["curve"]:
            apart = max(apart, abs(t.acceptance_length - methods[method]["curve"][str(k)]))
    for method, entry in methods.items():
        if method != NO_DRAFTER:
            fill_from_one_pass(entry)
    return {
        "definition": DEFINITION,
        "acceptance_length": head.acceptance_length,  # the drafter at draft_steps: the run's headline
        "draft_steps": cfg.draft_steps,
        "decode": cfg.decode,  # curve: every k decoded; headline: draft_steps alone, the rest by one pass (measured_by)
        "max_new_tokens": cfg.max_new_tokens,
        "stop_ids": measured.stop_ids,
        "methods": methods,
        "over_lookup": over_lookup(measured),  # drafter - lookup at each k both decoded, with its interval over prompts
        "greedy_check": {"checked": measured.checked,
                         "matched": measured.checked - len(measured.mismatches) - len(measured.near_ties),
                         "mismatches": measured.mismatches, "near_ties": measured.near_ties,
                         "near_tie_logits": measured.tolerance},
        "prompts": measured.rows,
        "too_long": measured.too_long,  # left out, never decoded: longer than prompt_limit
        "steps": head.passes,
        "tokens": sum(r["tokens"] for r in measured.rows),
        "layer_ids": layer_ids,
        "one_pass_apart": None if measured.one_pass_error else apart,  # the largest |decoded - one-pass| over methods and k
        "one_pass_error": measured.one_pass_error,  # why there is no one-pass curve, where there is none
        "drafter_method": drafter_method,  # eagle3: a chain of k one-token passes; dflash: one block pass of k tokens
        "seconds": measured.seconds,
    }


def over_lookup(measured: SetRun) -> dict[str, Any]:
    """k -> the drafter's acceptance length minus prompt lookup's, with its bootstrap interval over the set's
    prompts (``margin.paired_difference``), at every k where both were decoded: the margin a drafter must clear,
    said with how far another draw of prompts would move it."""
    found = {}
    for method, k in sorted(measured.tallies):
        if method != DRAFTER or (LOOKUP, k) not in measured.tallies:
            continue
        counts = {one: [(row["emitted"][one][str(k)], row["passes"][one][str(k)]) for row in measured.rows]
                  for one in (DRAFTER, LOOKUP)}
        difference = paired_difference(counts[DRAFTER], counts[LOOKUP])
        if difference is not None:
            found[str(k)] = difference
    return found


def fill_from_one_pass(entry: dict[str, Any]) -> None:
    """A method's curve with every k: the decoded ones as they are, the rest (``evaluate.decode = "headline"``)
    from its one-pass curve; ``measured_by`` says which is which."""
    entry["measured_by"] = dict.fromkeys(entry["curve"], "decode")
    one = entry.get("one_pass", {"curve": {}})
    for k in sorted(one["curve"].keys() - entry["curve"].keys(), key=int):
        for part in ("curve", "emitted", "passes"):
            entry[part][k] = one[part][k]
        entry["measured_by"][k] = "one_pass"
    for part in ("curve", "emitted", "passes", "measured_by"):
        entry[part] = dict(sorted(entry[part].items(), key=lambda item: int(item[0])))


def evaluate_sets(
    target: Any, tokenizer: Any, drafter: TargetTied, sets: list[EvalSet], cfg: EvalConfig,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Every set; the first one's drafter numbers stay at the top level, where the status page reads them."""
    total, before = sum(len(s.prompts) for s in sets), 0
    reports = {}
    for one in sets:
        step = None if progress is None else functools.partial(_overall_progress, progress, before, total)
        reports[one.name] = {**evaluate_prompts(target, tokenizer, drafter, one.prompts, cfg, step, name=one.name),
                             "excluded": one.excluded, "processes": 1}
        before += len(one.prompts)
        log.info("evaluation set %s: %d prompts in %.1fs, acceptance length %.3f at k=%d", one.name, len(one.prompts),
                 reports[one.name]["seconds"], reports[one.name]["acceptance_length"], cfg.draft_steps)
    return combine_sets(reports)


def combine_sets(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The whole report: the first set's drafter numbers at the top level, where the status page reads them."""
    headline = next(iter(reports.values()))
    return {**headline, "headline_set": next(iter(reports)), "sets": reports}


def _overall_progress(progress: Callable[[int, int], None], before: int, total: int, done: int, _: int) -> None:
    progress(before + done, total)  # prompts of earlier sets count as done


def verify_greedy_equality(report: dict[str, Any]) -> None:
    """Raise SpeculativeMismatch when any decode of any set differed from the target's greedy output at a
    position the target does not score as a near tie (those are counted, under ``near_ties``)."""
    mismatches = [m for one in report["sets"].values() for m in one["greedy_check"]["mismatches"]]
    if mismatches:
        checked = sum(one["greedy_check"]["checked"] for one in report["sets"].values())
        first = mismatches[0]
        raise SpeculativeMismatch(
            f"{len(mismatches)} of {checked} speculative decodes differ from the target's greedy output; first: "
            f"set {first['set']}, prompt {first['sample_id']}, method {first['method']}, k {first['k']}, "
            f"first differing position {first['position']}")


def load_target(model_dir: Path, device: torch.device, dtype: torch.dtype | None = None, *,
                trust_remote_code: bool = False) -> tuple[Any, Any]:
    """The target for evaluation (float32 unless told otherwise: the greedy-equality check is tightest there)
    and its tokenizer; decoding stops at the chat template's end-of-turn token as well as at eos, as the
    built-in server does. Code the directory ships runs only with ``trust_remote_code`` (``runtime.remote_code``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.type == "cuda":
        avoid_cudnn_attention()  # every verification pass meets a new key length
    target = load_from_target(AutoModelForCausalLM.from_pretrained, model_dir, trust_remote_code=trust_remote_code,
                              dtype=dtype or torch.float32).to(device).eval()
    if device.type == "cuda":
        # A verification pass on a GPU is bound by SDPA's masked kernels (verify_attention says why). A CPU keeps
        # SDPA: the profile that chose this was a GPU's, and on a CPU the engine-acceptance tests match vLLM's
        # counts to the token with SDPA.
        use_grouped_attention(target)
    tokenizer = load_from_target(AutoTokenizer.from_pretrained, model_dir, trust_remote_code=trust_remote_code)
    turn_end = find_turn_end(tokenizer).token_id
    if turn_end is not None and turn_end not in eos_ids_of(target):
        target.generation_config.eos_token_id = sorted(eos_ids_of(target) | {turn_end})
    return target, tokenizer


def load_evaluated(model_dir: Path, export_dir: Path, device: torch.device, dtype: torch.dtype | None = None, *,
                   trust_remote_code: bool = False) -> tuple[Any, Any, TargetTied]:
    """Target, tokenizer and the exported drafter (read as the engines read it, with the target's embedding)
    on ``device``: what every evaluation decodes with."""
    target, tokenizer = load_target(model_dir, device, dtype, trust_remote_code=trust_remote_code)
    return target, tokenizer, exported_drafter(target, model_dir, export_dir)


def exported_drafter(target: Any, model_dir: Path, export_dir: Path) -> TargetTied:
    """An exported drafter as the engines read it, with ``target``'s embedding, on ``target``'s device."""
    from modeling.dflash_export import is_dflash_export, load_dflash
    from modeling.export import load_drafter

    embed = target.get_input_embeddings().weight.detach().float().cpu()
    load = load_dflash if is_dflash_export(export_dir) else load_drafter
    return load(export_dir, model_dir, embed=embed).to(target.device).eval()
