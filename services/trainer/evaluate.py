"""Acceptance length: greedy chain speculative decoding against the target, with baselines and checks.

The target is the real Hugging Face model with a KV cache. Per verification pass a proposer offers up
to k tokens in a chain, the target checks them in one forward pass, and the output is the target's own
greedy decoding, token for token; only the number of target passes changes.

Acceptance length = tokens emitted by verification passes / verification passes, summed over every
prompt of a set (a ratio of sums, not a mean of per-prompt ratios); the prompt's prefill pass and the
first token it yields count in neither. Per set it is measured, on the same prompts in the same run:

- ``drafter``: the EAGLE-3 drafter at k = 1 .. ``curve_max_steps`` (the curve) and at ``draft_steps``
  (the headline the status page, exporter and demo show);
- ``lookup``: prompt lookup (n-gram) drafting, vLLM's ``ngram`` method, at the same k;
- ``no_drafter``: plain greedy decoding through the same loop, 1.0 by construction, measured anyway.

Every k is a real decode. Each decode is compared with the target's ``generate(do_sample=False)``
output, computed once per prompt; the report counts the decodes checked and matched per set, and
``verify_greedy_equality`` turns any mismatch into a SpeculativeMismatch once the report is written.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from shared.chat_turns import find_turn_end
from shared.errors import SpeculativeMismatch
from shared.runspec import EvalConfig
from services.trainer.evalsets import EvalPrompt, EvalSet
from services.trainer.lookup import LookupProposer, NoProposer
from services.trainer.model import Eagle3Drafter, KVCache

log = logging.getLogger(__name__)


class Proposer(Protocol):
    """What the decoding loop needs from a drafter."""

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        """Take the target's aux states (m, 3Ht) at m newly verified positions and, for each, the token
        that follows it (the last one is the target's newest token, not yet fed to the target)."""

    def propose(self, k: int) -> list[int]:
        """At most ``k`` next tokens (target ids) after the newest token; fewer, or none, is allowed."""


class DrafterProposer:
    """The EAGLE-3 drafter: a persistent cache over verified positions, a temporary chain per proposal."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        self.cache = KVCache()
        self.length = 0  # verified positions in the cache
        self.last: torch.Tensor | None = None  # (1, 1, H) output at the newest verified position

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        d, m = self.drafter, aux.shape[0]
        hidden = d.fuse(aux[None].to(self.device, d.fc.weight.dtype))  # (1, m, H)
        tokens = torch.tensor([next_tokens], device=self.device)  # (1, m): position p pairs with x_{p+1}
        positions = torch.arange(self.length, self.length + m, device=self.device)[None]  # (1, m)
        self.last = d(hidden, tokens, positions, self.cache)[:, -1:]  # (1, 1, H)
        self.length += m

    def propose(self, k: int) -> list[int]:
        d, hidden, drafts = self.drafter, self.last, []
        for j in range(k):
            if j > 0:  # chain step j: own previous output + the token it just proposed, one position on
                token = torch.tensor([[drafts[-1]]], device=self.device)
                position = torch.tensor([[self.length - 1 + j]], device=self.device)
                hidden = d(hidden, token, position, self.cache)  # (1, 1, H)
            drafts.append(int(d.to_target_ids(d.logits(hidden)[0, -1].argmax())))
        self.cache.crop(self.length)  # chain entries are recomputed from the target's states next time
        return drafts


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, the prefill's first token included
    accepted: list[int] = field(default_factory=list)  # tokens each verification step emitted

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


def aux_states(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """(T, 3H) from HF ``output_hidden_states`` (index 0 = embeddings, so layer i's output is i + 1)."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def crop_cache(cache: Any, keep: int) -> None:
    remove = cache.get_seq_length() - keep
    if remove > 0:  # a negative argument removes that many tokens in every transformers version
        cache.crop(-remove)


def cache_kwarg(target: Any) -> str:
    """transformers 5.2x renames ``past_key_values`` to ``cache``; older versions know only the former."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def eos_ids_of(target: Any) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def accepted_prefix(drafts: list[int], greedy: list[int]) -> int:
    """Accept rule: draft i (0-based) is accepted when drafts 0..i-1 were and it equals greedy[i], the
    target's own choice after the tokens before it. With a accepted, the step emits drafts[:a] plus
    greedy[a]: the correction where drafts[a] was wrong, or the bonus token after a fully accepted chain.
    Every emitted token is thus the target's greedy token, and one target pass yields a + 1 of them."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return accepted


def finished(tokens: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Where greedy decoding (``generate``) stops: at the budget or right after an eos token."""
    return len(tokens) >= max_new_tokens or tokens[-1] in eos


@dataclass
class Prefill:
    """The target's pass over a prompt, shared by every decode of it: each decode crops the cache back to
    the prompt (exact: cropping only drops entries) instead of reading the prompt again."""

    cache: Any  # transformers DynamicCache
    first: int  # the target's greedy token after the prompt
    aux: torch.Tensor  # (P, 3Ht) aux states at the prompt's positions
    length: int


@torch.inference_mode()
def prefill_prompt(target: Any, prompt_ids: list[int], layer_ids: list[int]) -> Prefill:
    from transformers import DynamicCache

    cache = DynamicCache()
    out = target(torch.tensor([prompt_ids], device=target.device), use_cache=True, output_hidden_states=True,
                 **{cache_kwarg(target): cache})
    return Prefill(cache, int(out.logits[0, -1].argmax()), aux_states(out.hidden_states, layer_ids), len(prompt_ids))


@torch.inference_mode()
def speculative_generate(
    target: Any, proposer: Proposer, prompt_ids: list[int], *, max_new_tokens: int, draft_steps: int, layer_ids: list[int],
    prefill: Prefill | None = None,
) -> DecodeResult:
    """Greedy chain speculative decoding; the proposer may propose fewer than ``draft_steps`` tokens, or
    none (then the pass verifies only the newest token and emits exactly one)."""
    pre = prefill if prefill is not None else prefill_prompt(target, prompt_ids, layer_ids)
    crop_cache(pre.cache, pre.length)
    device, eos, cache = target.device, eos_ids_of(target), pre.cache
    forward = functools.partial(target, use_cache=True, output_hidden_states=True, **{cache_kwarg(target): cache})
    result = DecodeResult(tokens=[pre.first])
    proposer.extend(pre.aux, prompt_ids[1:] + result.tokens)
    while not finished(result.tokens, max_new_tokens, eos):
        drafts = proposer.propose(draft_steps)
        if len(drafts) > draft_steps:
            raise ValueError(f"{type(proposer).__name__} proposed {len(drafts)} tokens, more than the {draft_steps} asked")
        context = cache.get_seq_length()
        out = forward(torch.tensor([[result.tokens[-1], *drafts]], device=device))  # positions context .. context+len(drafts)
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[i]: the target's choice after block token i
        accepted = accepted_prefix(drafts, greedy)
        new = [*drafts[:accepted], greedy[accepted]]
        emitted = 0
        while emitted < len(new) and not finished(result.tokens, max_new_tokens, eos):
            result.tokens.append(new[emitted])
            emitted += 1
        result.accepted.append(emitted)
        crop_cache(cache, context + accepted + 1)  # keep the newest token and the accepted drafts
        if not finished(result.tokens, max_new_tokens, eos):
            proposer.extend(aux_states(out.hidden_states, layer_ids)[: accepted + 1], new)
    return result


# ---- a run's evaluation --------------------------------------------------------------------------

DRAFTER, LOOKUP, NO_DRAFTER = "drafter", "lookup", "no_drafter"
DEFINITION = ("acceptance length = sum of tokens emitted by target verification passes / number of those passes, "
              "over every prompt of the set; greedy, chain drafting of k tokens per pass; the prompt's prefill pass "
              "and the token it yields count in neither")


@torch.inference_mode()
def greedy_reference(target: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy output (``generate``), which every speculative decode must reproduce."""
    ids = torch.tensor([prompt_ids], device=target.device)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(eos_ids_of(target)) or None)
    return out[0, len(prompt_ids):].tolist()


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where the two differ (a missing token counts), or None when equal."""
    for position, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return position
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def chain_lengths(cfg: EvalConfig) -> list[int]:
    """k = 1 .. curve_max_steps, and the headline ``draft_steps`` where it lies beyond."""
    return sorted(set(range(1, cfg.curve_max_steps + 1)) | {cfg.draft_steps})


@dataclass
class Tally:
    """Emitted tokens and verification passes of one method at one k, summed over a set."""

    emitted: int = 0
    passes: int = 0

    def add(self, decoded: DecodeResult) -> None:
        self.emitted += sum(decoded.accepted)
        self.passes += decoded.steps

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0


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
    rows: list[dict] = field(default_factory=list)
    checked: int = 0
    mismatches: list[dict] = field(default_factory=list)
    near_ties: list[dict] = field(default_factory=list)
    tolerance: float = 0.0  # NEAR_TIE_LOGITS of the target's dtype
    seconds: float = 0.0  # spent decoding this set (in parallel shares: the slowest share's)

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
                "near_ties": self.near_ties, "tolerance": self.tolerance, "seconds": self.seconds,
                "tallies": [[m, k, t.emitted, t.passes] for (m, k), t in self.tallies.items()]}

    def merge(self, other: dict[str, Any]) -> None:
        """Add another process's share of the same set (``to_json``'s form)."""
        self.rows += other["rows"]
        self.checked += other["checked"]
        self.mismatches += other["mismatches"]
        self.near_ties += other["near_ties"]
        self.tolerance = max(self.tolerance, other["tolerance"])  # a share with no prompt never set it
        self.seconds = max(self.seconds, other["seconds"])  # the shares ran at the same time
        for method, k, emitted, passes in other["tallies"]:
            tally = self.tallies.setdefault((method, k), Tally())
            tally.emitted += emitted
            tally.passes += passes


@torch.inference_mode()
def logit_gap(target: Any, prompt_ids: list[int], reference: list[int], position: int, tokens: list[int]) -> float | None:
    """How far apart the target scores the two tokens where a decode left ``reference``: one plain forward
    over the prompt and the shared prefix. None where one output simply has no token there."""
    if position >= len(reference) or position >= len(tokens):
        return None
    logits = target(torch.tensor([prompt_ids + reference[:position]], device=target.device)).logits[0, -1].float()
    return abs(float(logits[reference[position]] - logits[tokens[position]]))


def decode_all(
    target: Any, drafter: Eagle3Drafter, ids: list[int], cfg: EvalConfig, layer_ids: list[int]
) -> dict[tuple[str, int], DecodeResult]:
    """Every decode of one prompt: the drafter and prompt lookup at each k, and no drafter (k = 0)."""
    pre = prefill_prompt(target, ids, layer_ids)
    run = functools.partial(speculative_generate, target, prompt_ids=ids, max_new_tokens=cfg.max_new_tokens,
                            layer_ids=layer_ids, prefill=pre)
    decodes = {(DRAFTER, k): run(DrafterProposer(drafter), draft_steps=k) for k in chain_lengths(cfg)}
    if cfg.baselines:
        for k in chain_lengths(cfg):
            decodes[(LOOKUP, k)] = run(LookupProposer(ids[0], min_n=cfg.lookup_min, max_n=cfg.lookup_max), draft_steps=k)
        decodes[(NO_DRAFTER, 0)] = run(NoProposer(), draft_steps=0)
    return decodes


def prompt_row(prompt: EvalPrompt, ids: list[int], decodes: dict[tuple[str, int], DecodeResult], cfg: EvalConfig) -> dict:
    """The headline decode's steps, as before, and every decode's pass count."""
    head = decodes[(DRAFTER, cfg.draft_steps)]
    passes: dict[str, Any] = {}
    for (method, k), decoded in decodes.items():
        if method == NO_DRAFTER:
            passes[method] = decoded.steps
        else:
            passes.setdefault(method, {})[str(k)] = decoded.steps
    return {"sample_id": prompt.sample_id, "prompt_tokens": len(ids), "tokens": len(head.tokens), "steps": head.steps,
            "accepted": head.accepted, "acceptance_length": head.acceptance_length, "passes": passes}


def measure_prompt(target: Any, tokenizer: Any, drafter: Eagle3Drafter, prompt: EvalPrompt, cfg: EvalConfig,
                   measured: SetRun) -> None:
    """Every decode of one prompt, each checked against ``generate``, added to ``measured``."""
    started = time.monotonic()
    layer_ids = list(drafter.config.layer_ids)
    ids = list(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    reference = greedy_reference(target, ids, cfg.max_new_tokens)
    decodes = decode_all(target, drafter, ids, cfg, layer_ids)
    gap = functools.partial(logit_gap, target, ids, reference)
    measured.tolerance = NEAR_TIE_LOGITS.get(target.dtype, 0.0)
    for (method, k), decoded in decodes.items():
        measured.record(prompt, method, k, decoded, reference, gap)
    measured.rows.append(prompt_row(prompt, ids, decodes, cfg))
    measured.seconds += time.monotonic() - started


def evaluate_prompts(
    target: Any, tokenizer: Any, drafter: Eagle3Drafter, prompts: list[EvalPrompt], cfg: EvalConfig,
    progress: Callable[[int, int], None] | None = None, *, name: str = "holdout",
) -> dict[str, Any]:
    """One set: every prompt decoded by every method at every k, each decode checked against ``generate``."""
    measured = SetRun(name)
    for done, prompt in enumerate(prompts, start=1):
        measure_prompt(target, tokenizer, drafter, prompt, cfg, measured)
        if progress is not None:
            progress(done, len(prompts))
    return set_report(measured, cfg, list(drafter.config.layer_ids))


def set_report(measured: SetRun, cfg: EvalConfig, layer_ids: list[int]) -> dict[str, Any]:
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
    return {
        "definition": DEFINITION,
        "acceptance_length": head.acceptance_length,  # the drafter at draft_steps: the run's headline
        "draft_steps": cfg.draft_steps,
        "max_new_tokens": cfg.max_new_tokens,
        "methods": methods,
        "greedy_check": {"checked": measured.checked,
                         "matched": measured.checked - len(measured.mismatches) - len(measured.near_ties),
                         "mismatches": measured.mismatches, "near_ties": measured.near_ties,
                         "near_tie_logits": measured.tolerance},
        "prompts": measured.rows,
        "steps": head.passes,
        "tokens": sum(r["tokens"] for r in measured.rows),
        "layer_ids": layer_ids,
        "seconds": measured.seconds,
    }


def evaluate_sets(
    target: Any, tokenizer: Any, drafter: Eagle3Drafter, sets: list[EvalSet], cfg: EvalConfig,
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


def load_target(model_dir: Path, device: torch.device, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """The target for evaluation (float32 unless told otherwise: the greedy-equality check is tightest there)
    and its tokenizer; decoding stops at the chat template's end-of-turn token as well as at eos, as the
    built-in server does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    turn_end = find_turn_end(tokenizer).token_id
    if turn_end is not None and turn_end not in eos_ids_of(target):
        target.generation_config.eos_token_id = sorted(eos_ids_of(target) | {turn_end})
    return target, tokenizer


def load_evaluated(model_dir: Path, export_dir: Path, device: torch.device,
                   dtype: torch.dtype | None = None) -> tuple[Any, Any, Eagle3Drafter]:
    """Target, tokenizer and the exported drafter (read as the engines read it, with the target's embedding)
    on ``device``: what every evaluation decodes with."""
    target, tokenizer = load_target(model_dir, device, dtype)
    return target, tokenizer, exported_drafter(target, model_dir, export_dir)


def exported_drafter(target: Any, model_dir: Path, export_dir: Path) -> Eagle3Drafter:
    """An exported drafter as the engines read it, with ``target``'s embedding, on ``target``'s device."""
    from services.trainer.export import load_drafter

    embed = target.get_input_embeddings().weight.detach().float().cpu()
    return load_drafter(export_dir, model_dir, embed=embed).to(target.device).eval()
