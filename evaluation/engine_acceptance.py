"""Acceptance as the serving engine measures it: the exported drafter served by a real vLLM, counted by
vLLM's own ``/metrics``, beside the evaluator's figure on the same prompts and k.

vLLM runs the export exactly as a user's deployment would: ``--speculative-config`` with method
``eagle3`` or ``dflash`` (as the export's config says), the export directory as the drafter and
``num_speculative_tokens = k``. Each prompt goes alone, as its token ids (nothing is re-rendered), greedy,
with the evaluator's token budget and stop tokens. vLLM counts every decode step that drafted
(``vllm:spec_decode_num_drafts``) and every drafted token the target accepted (``vllm:spec_decode_num_accepted_tokens``); its mean acceptance length is
``1 + accepted / drafts``: the tokens one verification pass yields, which is the evaluator's definition
(a prompt's prefill pass and its token count in neither). The counters are read before and after, so a
server that served anything else first does not count it.

One counting difference is taken into account: at a reply's end (its budget, or an eos) vLLM still counts
the drafts the target accepted past it, which no pass emits; the evaluator counts those too
(``DecodeResult.matched``), and the agreement is judged on that like-for-like figure, while its own
headline counts only emitted tokens.

The engine's replies are compared token for token with the evaluator's decodes of the same prompts:
greedy speculative decoding must emit the target's own text in both. A figure that disagrees with the
evaluator's by more than the tolerance means one of the two reads the export differently from the
other, and the export cannot be trusted to serve what the evaluation promised.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared.drafter_format import read_config, speculative_method
from shared.errors import DraftlineError
from evaluation.evaluate import first_difference
from evaluation.vllm_launch import vllm_server

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
REQUEST_TIMEOUT_S = 600.0
DEFINITION = ("vLLM's mean acceptance length, 1 + accepted / drafts, from the deltas of its /metrics counters "
              f"{ACCEPTED} and {DRAFTS} over these prompts, sent one at a time, greedy, as token ids")


class EngineMetricsMissing(DraftlineError):
    """The server's ``/metrics`` has no speculative-decoding counters: it runs without a drafter, or a vLLM
    whose metric names differ from the ones read here."""


class EngineAcceptanceMismatch(DraftlineError):
    """vLLM's acceptance length for the export differs from the evaluator's on the same prompts and k by
    more than the tolerance, or its greedy text differs: the two read the export differently."""


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over their labels."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                            self.accepted - earlier.accepted)

    @property
    def acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


def parse_counters(text: str, *, required: bool = True) -> SpecCounters:
    """The three counters from a Prometheus exposition; EngineMetricsMissing where ``required`` and absent."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    if required and DRAFTS not in totals:
        raise EngineMetricsMissing(f"no {DRAFTS} in the engine's /metrics (is a drafter configured?)")
    return SpecCounters(totals.get(DRAFTS, 0.0), totals.get(DRAFT_TOKENS, 0.0), totals.get(ACCEPTED, 0.0))


def read_counters(client: httpx.Client, url: str, *, required: bool = True) -> SpecCounters:
    response = client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_counters(response.text, required=required)


def speculative_args(export_dir: Path, k: int) -> list[str]:
    """The flag that serves ``export_dir`` as the drafter it is (EAGLE-3 or DFlash) proposing ``k`` tokens per
    step (DFlash: ``k`` mask slots in one pass)."""
    method = speculative_method(read_config(Path(export_dir)))
    config = {"method": method, "model": str(export_dir), "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(config)]


def served_model(client: httpx.Client, url: str) -> str:
    response = client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def complete(client: httpx.Client, url: str, model: str, prompt: list[int], max_new_tokens: int,
             stop_ids: Sequence[int]) -> list[int]:
    """vLLM's greedy reply to ``prompt`` (token ids), as token ids; it ends at a stop token (kept) or the budget."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0,
            "stop_token_ids": sorted(stop_ids), "return_token_ids": True}
    response = client.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


@dataclass(frozen=True)
class EngineDecode:
    """What one served configuration produced for a list of prompts."""

    replies: list[list[int]]
    counters: SpecCounters  # over these prompts only; zero without a drafter
    seconds: float

    @property
    def acceptance_length(self) -> float | None:
        return self.counters.acceptance_length


def decode_prompts(url: str, prompts: Sequence[list[int]], max_new_tokens: int, stop_ids: Sequence[int], *,
                   drafter: bool = True) -> EngineDecode:
    """Every prompt, one at a time, against a running server; the counters' change over them."""
    started = time.monotonic()
    with httpx.Client(timeout=60) as client:
        model = served_model(client, url)
        before = read_counters(client, url, required=drafter)
        replies = [complete(client, url, model, p, max_new_tokens, stop_ids) for p in prompts]
        after = read_counters(client, url, required=drafter)
    return EngineDecode(replies, after.minus(before), time.monotonic() - started)


@dataclass(frozen=True)
class EngineLaunch:
    """How to start the serving engine for a measurement: the command that starts vLLM's OpenAI server, the
    target it serves, where its output goes, its extra arguments (``--dtype``, ``--enforce-eager``, ...), how
    long it may take to become healthy and what its ``PYTHONPATH`` gains."""

    command: Sequence[str]
    model_dir: Path
    log_path: Path
    engine_args: Sequence[str] = ()
    timeout_s: float = 900.0
    pythonpath: Sequence[Path] = ()


def serve_and_decode(launch: EngineLaunch, export_dir: Path | None, k: int, prompts: Sequence[list[int]],
                     max_new_tokens: int, stop_ids: Sequence[int]) -> EngineDecode:
    """Start vLLM as ``launch`` says (with ``export_dir`` as its EAGLE-3 drafter at ``k``, or without one when
    None), decode ``prompts``, stop it."""
    args = [*launch.engine_args, *(speculative_args(export_dir, k) if export_dir is not None else [])]
    with vllm_server(launch.command, launch.model_dir, launch.log_path, args, timeout=launch.timeout_s,
                     pythonpath=launch.pythonpath) as url:
        return decode_prompts(url, prompts, max_new_tokens, stop_ids, drafter=export_dir is not None)


def first_mismatch(replies: Sequence[list[int]], references: Sequence[list[int]]) -> dict[str, int] | None:
    """The first prompt (index) and position where the two lists of replies part, or None."""
    for index, (mine, theirs) in enumerate(zip(replies, references, strict=True)):
        position = first_difference(mine, theirs)
        if position is not None:
            return {"prompt": index, "position": position}
    return None


def compare(decoded: EngineDecode, rows: Sequence[dict[str, Any]], *, k: int, set_name: str, tolerance: float) -> dict[str, Any]:
    """vLLM's figure beside the evaluator's for the same prompts (``rows``: the evaluation report's prompt rows
    of the headline decode at ``k``), and the two decodes' texts compared."""
    emitted = sum(sum(row["accepted"]) for row in rows)
    passes = sum(row["steps"] for row in rows)
    matched = sum(sum(row["matched"]) for row in rows)
    ours = emitted / passes if passes else None
    # vLLM counts a pass's accepted drafts also past the reply's end, where none is emitted: the like-for-like
    # figure is the evaluator's count of the same (DecodeResult.matched).
    ours_counted_as_vllm = 1 + matched / passes if passes else None
    engine = decoded.acceptance_length
    references = [row["reply"] for row in rows]
    mismatch = first_mismatch(decoded.replies, references)
    difference = None if engine is None or ours_counted_as_vllm is None else engine - ours_counted_as_vllm
    return {
        "engine": "vllm",
        "definition": DEFINITION,
        "set": set_name,
        "k": k,
        "prompts": len(rows),
        "sample_ids": [row["sample_id"] for row in rows],
        "acceptance_length": engine,
        "evaluator_acceptance_length": ours,
        "evaluator_counted_as_vllm": ours_counted_as_vllm,
        "evaluator_emitted": emitted,
        "evaluator_passes": passes,
        "evaluator_accepted_drafts": matched,
        "difference": difference,
        "tolerance": tolerance,
        "drafts": decoded.counters.drafts,
        "draft_tokens": decoded.counters.draft_tokens,
        "accepted": decoded.counters.accepted,
        "greedy_match": {"checked": len(rows), "matched": sum(a == b for a, b in zip(decoded.replies, references)),
                         "first_mismatch": mismatch},
        "agrees": difference is not None and abs(difference) <= tolerance and mismatch is None,
        "seconds": decoded.seconds,
    }


def verify_agreement(engine: dict[str, Any]) -> None:
    """EngineAcceptanceMismatch where ``compare`` found the two figures or texts apart."""
    if engine["agrees"]:
        return
    mismatch = engine["greedy_match"]["first_mismatch"]
    where = "" if mismatch is None else (f"; its text differs from the evaluator's at prompt "
                                         f"{engine['sample_ids'][mismatch['prompt']]}, token {mismatch['position']}")
    raise EngineAcceptanceMismatch(
        f"vLLM measures acceptance length {engine['acceptance_length']} for the export at k={engine['k']} on "
        f"{engine['prompts']} prompts of {engine['set']}, the evaluator {engine['evaluator_counted_as_vllm']} counted "
        f"as vLLM counts (tolerance {engine['tolerance']}){where}")


def measure_export(launch: EngineLaunch, export_dir: Path, report: dict[str, Any],
                   prompts: Sequence[tuple[int, list[int]]], *, tolerance: float) -> dict[str, Any]:
    """vLLM's acceptance for the export on ``prompts`` ((sample id, prompt ids) of the report's headline set),
    at the report's k and token budget, beside the evaluator's on the same prompts (``compare``)."""
    name = report["headline_set"]
    one = report["sets"][name]
    rows = {row["sample_id"]: row for row in one["prompts"]}
    decoded = serve_and_decode(launch, export_dir, report["draft_steps"], [ids for _, ids in prompts],
                               report["max_new_tokens"], one["stop_ids"])
    measured = compare(decoded, [rows[sample_id] for sample_id, _ in prompts], k=report["draft_steps"], set_name=name,
                       tolerance=tolerance)
    log.info("vLLM measures acceptance length %s at k=%d on %d prompts of %s; the evaluator %s counted as vLLM counts "
             "(%s emitted tokens only)", measured["acceptance_length"], measured["k"], measured["prompts"], name,
             measured["evaluator_counted_as_vllm"], measured["evaluator_acceptance_length"])
    return measured
