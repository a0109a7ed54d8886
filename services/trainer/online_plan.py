"""An online run's plan: the samples it trains and holds out, and each training sample's length and learned
tokens, all read from the stored replies before any state is extracted.

Rank 0 writes the plan once, when training first starts (``online_plan.json``); every rank and every resume read
it. What it fixes:

- **the samples**: those with a reply when generation settled and no extraction failure, less the
  ``train.validation_files`` held out (picked by the same hash of the sample id as offline);
- **each training sample's tokens**: how many its file will hold, from its reply record through
  ``shared.sample_tokens.sample_of``, the very function extraction builds the file's ids with, so the epochs are
  planned by length as an offline run's are (``sources.epoch_plan``) and the window of files asked for ahead is
  sized in bytes before a file exists;
- **the draft vocabulary's tally**: the loss-masked tokens of every training sample, the count an offline run
  makes from its files (``online_vocabulary.safetensors``, beside the plan);
- a reply that can make no sample (a prompt longer than ``extraction.max_length``, a torn record) is recorded as
  the extraction failure extraction itself would record, and trains in no epoch.

What the first start measures and chooses later (the epochs, the target's name and fingerprint, DFlash's mask
token) is recorded in the plan's ``facts`` for every resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from runtime.remote_code import load_from_target
from runtime.space import write_with_space
from services.trainer.validation import validation_split
from services.trainer.vocab import TokenTally
from shared.atomic import atomic_write_json, read_json
from shared.errors import DraftlineError, error_class
from shared.layout import RunPaths
from shared.lifecycle import Failure, Stage
from shared.runspec import RunSpec
from shared.sample_tokens import read_reply, sample_of, target_turn_end

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a rank other than 0 looks for rank 0's plan
PLAN_WAIT_S = 3600.0  # how long it waits for it (a plan of a million replies takes minutes to read)
READ_THREADS = 8  # reply records read at once (a plan of a million samples reads a million small files)
LOG_EVERY = 50_000  # samples between two progress lines of a long plan
FACTS = "facts"  # the plan file's record of what the first start measured: epochs, target, DFlash's mask token


class OnlinePlanError(DraftlineError):
    """The online run has no samples to train on, or its plan on the volume cannot be read."""


@dataclass(frozen=True)
class OnlinePlan:
    train_ids: list[int]
    validation_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # each training sample's file length (extraction.max_length cut)

    def to_json(self) -> dict:
        return {"train_ids": self.train_ids, "validation_ids": self.validation_ids, "tokens": self.tokens}


@dataclass
class PlanFailure:
    sample_id: int
    error: Exception


class ReplyTokens:
    """A sample's ``(input_ids, loss_mask)`` from its reply record, as extraction will build its file: the
    engine's own ids where the record has them, else the target's chat template (its tokenizer loaded once, only
    when a record needs it)."""

    def __init__(self, paths: RunPaths, spec: RunSpec, model_dir: Path, trust_remote_code: bool = False) -> None:
        self.paths, self.max_length = paths, spec.extraction.max_length
        self.model_dir, self.trust_remote_code = Path(model_dir), trust_remote_code

    @cached_property
    def _template(self):
        from transformers import AutoTokenizer

        tokenizer = load_from_target(AutoTokenizer.from_pretrained, self.model_dir,
                                     trust_remote_code=self.trust_remote_code)
        return tokenizer, target_turn_end(tokenizer, self.model_dir)

    def __call__(self, sample_id: int) -> tuple[list[int], list[int]]:
        path = self.paths.generated(sample_id)
        record = read_reply(path)
        tokenizer, turn_end = (None, None) if _engine_only(record) else self._template
        input_ids, loss_mask, _ = sample_of(record, tokenizer, turn_end, self.max_length, path)
        return input_ids, loss_mask


def _engine_only(record: dict) -> bool:
    """Every turn of the record carries the engine's ids: no template renders anything."""
    turns = record.get("turns") if isinstance(record.get("turns"), list) else []
    return record.get("token_ids") is not None and all(
        isinstance(t, dict) and t.get("token_ids") is not None for t in turns)


SampleTokens = Callable[[int], tuple[list[int], list[int]]]


def with_replies(paths: RunPaths, spec: RunSpec) -> list[tuple[int, Path]]:
    return [(i, paths.generated(i)) for i in range(spec.train_ids)
            if paths.generated(i).is_file() and not paths.failure(Stage.EXTRACT, i).is_file()]


def make_plan(paths: RunPaths, spec: RunSpec, sample_tokens: SampleTokens,
              tally: TokenTally) -> tuple[OnlinePlan, list[PlanFailure]]:
    """The plan (the samples whose reply is on the volume, less those held out, with their lengths), the training
    samples' learned tokens added to ``tally``, and the samples whose reply makes no sample."""
    replies = with_replies(paths, spec)
    if not replies:
        raise OnlinePlanError(f"run {spec.name}: no sample has a reply to extract and train on")
    trained, held = validation_split(replies, spec.train.validation_files)
    ids = {path: i for i, path in replies}
    train_ids, tokens, failures = [], [], []
    started = time.monotonic()
    with ThreadPoolExecutor(READ_THREADS) as pool:
        measured = pool.map(lambda i: _measure(sample_tokens, i), sorted(ids[p] for p in trained))
        for count, (sample_id, outcome) in enumerate(measured, start=1):
            if isinstance(outcome, Exception):
                failures.append(PlanFailure(sample_id, outcome))
            else:
                input_ids, loss_mask = outcome
                tally.add_ids(input_ids, loss_mask)
                train_ids.append(sample_id)
                tokens.append(len(input_ids))
            if count % LOG_EVERY == 0:
                log.info("run %s: online plan: %d of %d replies read (%.0f s)", spec.name, count, len(trained),
                         time.monotonic() - started)
    if not train_ids:
        raise OnlinePlanError(f"run {spec.name}: no reply of the {len(trained)} to train on makes a sample "
                              f"(failures/extract names each)")
    return OnlinePlan(train_ids, sorted(ids[p] for p in held), tokens), failures


def _measure(sample_tokens: SampleTokens, sample_id: int) -> tuple[int, tuple[list[int], list[int]] | Exception]:
    try:
        return sample_id, sample_tokens(sample_id)
    except DraftlineError as exc:  # a sample's own fault: named, the others go on
        return sample_id, exc


def read_plan(paths: RunPaths) -> OnlinePlan:
    try:
        raw = read_json(paths.online_plan)
        return OnlinePlan([int(i) for i in raw["train_ids"]], [int(i) for i in raw["validation_ids"]],
                          [int(n) for n in raw.get("tokens", [])])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OnlinePlanError(f"{paths.online_plan}: unreadable ({exc})") from None


def write_plan(paths: RunPaths, plan: OnlinePlan, tally: TokenTally) -> None:
    """The tally first, then the plan: a plan on the volume always has its tally beside it."""
    paths.online_plan.parent.mkdir(parents=True, exist_ok=True)
    write_with_space(lambda: tally.save(paths.online_vocabulary), "the online vocabulary's tally", paths.data)
    facts = plan_facts(paths)
    body = {**plan.to_json(), **({FACTS: facts} if facts is not None else {})}
    write_with_space(lambda: atomic_write_json(paths.online_plan, body), "the online plan", paths.data)


def load_plan(paths: RunPaths, spec: RunSpec, rank: int, sample_tokens: SampleTokens, *, vocab_size: int,
              on_failure: Callable[[PlanFailure], None] = lambda failure: None) -> tuple[OnlinePlan, TokenTally]:
    """The plan and its tally. Rank 0 reads them, or makes and writes them on the first start (and the lengths and
    tally of a plan an earlier version wrote without them); the other ranks wait for rank 0's."""
    max_length = spec.train_max_length
    deadline = time.monotonic() + PLAN_WAIT_S
    while True:
        plan = read_plan(paths) if paths.online_plan.is_file() else None
        if plan is not None and plan.tokens and paths.online_vocabulary.is_file():
            return plan, TokenTally.load(paths.online_vocabulary, max_length)
        if rank == 0:
            return _first_plan(paths, spec, sample_tokens, vocab_size, on_failure, plan)
        if time.monotonic() > deadline:
            raise OnlinePlanError(f"{paths.online_plan}: rank 0 wrote no plan within {PLAN_WAIT_S:.0f}s")
        time.sleep(POLL_S)


def _first_plan(paths: RunPaths, spec: RunSpec, sample_tokens: SampleTokens, vocab_size: int,
                on_failure: Callable[[PlanFailure], None], earlier: OnlinePlan | None) -> tuple[OnlinePlan, TokenTally]:
    tally = TokenTally(vocab_size, spec.train_max_length)
    started = time.monotonic()
    if earlier is None:
        plan, failures = make_plan(paths, spec, sample_tokens, tally)
    else:  # an earlier version's plan, without lengths: the same samples, measured now
        plan, failures = _measured(earlier, sample_tokens, tally)
    for failure in failures:
        on_failure(failure)
    write_plan(paths, plan, tally)
    log.info("run %s: online plan: %d samples to train (%d tokens in their files), %d held out for validation, "
             "%d replies that make no sample (failures/extract); the draft vocabulary counted over all of them "
             "(%.1f s)", spec.name, len(plan.train_ids), sum(plan.tokens), len(plan.validation_ids), len(failures),
             time.monotonic() - started)
    return plan, tally


def _measured(plan: OnlinePlan, sample_tokens: SampleTokens, tally: TokenTally) -> tuple[OnlinePlan, list[PlanFailure]]:
    """An earlier plan's samples with their lengths (a sample that fails keeps its place: the order is the earlier
    plan's, and its failure makes it train in no epoch)."""
    tokens, failures = [], []
    for sample_id in plan.train_ids:
        _, outcome = _measure(sample_tokens, sample_id)
        if isinstance(outcome, Exception):
            failures.append(PlanFailure(sample_id, outcome))
            tokens.append(0)
        else:
            tally.add_ids(*outcome)
            tokens.append(len(outcome[0]))
    return OnlinePlan(plan.train_ids, plan.validation_ids, tokens), failures


def plan_failure_record(run: str, failure: PlanFailure) -> Failure:
    """The extraction failure a reply that makes no sample is recorded as (what extraction would record)."""
    return Failure(run=run, stage=Stage.EXTRACT, sample_id=failure.sample_id, error_class=error_class(failure.error),
                   message=str(failure.error))


# ---- what the first start learned, for every resume ------------------------------------------------

def plan_facts(paths: RunPaths) -> dict | None:
    """What the first start recorded in the plan (None before it did)."""
    try:
        facts = read_json(paths.online_plan).get(FACTS)
    except (OSError, ValueError, AttributeError):
        return None
    return facts if isinstance(facts, dict) else None


def record_facts(paths: RunPaths, facts: dict) -> None:
    raw = read_json(paths.online_plan)
    raw[FACTS] = facts
    write_with_space(lambda: atomic_write_json(paths.online_plan, raw), "the online plan's facts", paths.data)


def wait_for_facts(paths: RunPaths) -> dict:
    """On a rank other than 0: rank 0's facts, once written."""
    deadline = time.monotonic() + PLAN_WAIT_S
    while (facts := plan_facts(paths)) is None:
        if time.monotonic() > deadline:
            raise OnlinePlanError(f"{paths.online_plan}: rank 0 recorded no facts within {PLAN_WAIT_S:.0f}s")
        time.sleep(POLL_S)
    return facts
