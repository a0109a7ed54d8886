"""Acceptance at every k from one pass over the target's greedy reply: what a sweep of drafters needs.

A greedy speculative decode emits the target's own greedy reply whatever proposes the drafts; the proposer
only changes how much of it each verification pass accepts. And a proposal depends only on what is verified
before it: prompt lookup reads the tokens; the EAGLE-3 drafter's cache over verified positions is rebuilt
from the target's states after every pass (``BatchDrafterProposer.extend``), and its chain then runs on its
own outputs; a DFlash block reads the verified positions' context. So the drafts a decode would make at
every point of the reply can be computed at once, from the reply itself:

- one target forward over prompt + reply gives the auxiliary states of every position;
- EAGLE-3: the training-time-test unroll (``model.ttt_unroll``, teacher-forced) gives every position's
  chain of K drafts. Only drafts up to the first wrong one count, and up to there the chain's own tokens
  *are* the reply's, so the teacher-forced chain drafts what the served chain drafts
  (tests/services/trainer/test_alignment.py pins the step-by-step equality);
- DFlash: one block pass per k over every anchor (a block's mask slots see each other, so a block of k
  drafts is not the first k slots of a longer one);
- prompt lookup: its proposal after every prefix (at k it is the first k tokens of the proposal at K).

Then, per k, the decode's own walk: with the reply's tokens r_0 .. r_{N-1} (r_0 from the prompt's prefill)
and r_0 .. r_i emitted, a pass verifies r_i and the drafts after it, accepts a = min(k, m_i) of them (m_i:
how many leading drafts equal r_{i+1}, r_{i+2}, ...) and emits min(a + 1, N - 1 - i) tokens; the walk
ends at N - 1. Acceptance length = emitted / passes summed over the prompts, the decoding evaluator's
definition (``evaluate.DEFINITION``).

What differs from decoding is rounding alone: the target's states come from one forward over the whole
sequence instead of the prefill and the verification passes' blocks, so a drafter argmax within rounding of
a tie can go the other way. In float64 the curves equal the decoded ones pass for pass
(tests/evaluation/test_one_pass.py); every evaluation reports both and their difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from modeling.dflash import DFlashDrafter
from evaluation.lookup import lookup_proposal
from evaluation.speculative import Tally
from evaluation.speculative_batch import pad_id_of
from modeling.eagle3 import Eagle3Drafter, TargetTied, ttt_unroll


@dataclass(frozen=True)
class Replay:
    """A prompt and the target's greedy reply to it (``generate``: ending at its first eos or the budget)."""

    prompt: list[int]
    reply: list[int]

    @property
    def states(self) -> int:
        """Points of the reply where a pass drafts: after r_0 .. r_{N-2} (after r_{N-1} the decode has ended)."""
        return max(len(self.reply) - 1, 0)


def leading_matches(drafts: Sequence[int], reply: Sequence[int], i: int) -> int:
    """How many of ``drafts`` (made with r_0 .. r_i emitted) equal r_{i+1}, r_{i+2}, ... from the first on."""
    matched = 0
    while matched < len(drafts) and i + 1 + matched < len(reply) and drafts[matched] == reply[i + 1 + matched]:
        matched += 1
    return matched


def walk(matches: Sequence[int], k: int) -> tuple[int, int]:
    """(tokens emitted, verification passes) of a greedy decode of a reply of ``len(matches) + 1`` tokens whose
    proposal at each point has ``matches[i]`` leading drafts right (each pass accepts at most ``k`` of them)."""
    last = len(matches)  # the reply's final index, N - 1
    emitted = passes = i = 0
    while i < last:
        step = min(min(k, matches[i]) + 1, last - i)
        emitted, passes, i = emitted + step, passes + 1, i + step
    return emitted, passes


# ---- the target's states over prompt + reply -----------------------------------------------------

# Most attention scores a drafter pass over a part of a batch holds at once (a float32 GiB): the dense unroll
# scores every position against every other, and DFlash's blocks every anchor's slots against the context.
SCORE_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class Span:
    """A reply inside a row of ``Rows``: r_0 at index ``start``, what comes before it the reply's prompt."""

    row: int
    start: int
    reply: list[int]

    @property
    def states(self) -> int:
        return max(len(self.reply) - 1, 0)


@dataclass
class Rows:
    """Token sequences (right-padded), the target's states over them by layer, and where the replies lie: a
    target's pass over prompt + reply (``target_pass``), or a hidden-state file's every assistant turn."""

    states: dict[int, torch.Tensor]  # layer id (decoder_output_0idx) -> (B, L, Ht)
    ids: torch.Tensor  # (B, L)
    spans: list[Span]

    def aux(self, layer_ids: Sequence[int]) -> torch.Tensor:
        """(B, L, nHt): the auxiliary layers' outputs in the drafter's order (``speculative_batch.aux_of``)."""
        return torch.cat([self.states[i] for i in layer_ids], dim=-1)

    def parts(self, cost_per_row: int) -> list[Rows]:
        """The rows in consecutive parts whose attention scores stay within ``SCORE_ELEMENTS``."""
        size = max(1, SCORE_ELEMENTS // max(cost_per_row, 1))
        found = []
        for first in range(0, self.ids.shape[0], size):
            rows = range(first, min(first + size, self.ids.shape[0]))
            spans = [Span(s.row - first, s.start, s.reply) for s in self.spans if s.row in rows]
            found.append(Rows({i: t[first: rows.stop] for i, t in self.states.items()}, self.ids[first: rows.stop], spans))
        return found


@torch.inference_mode()
def target_pass(target: object, replays: Sequence[Replay]) -> Rows:
    """The target's one forward over every replay's prompt + reply, right-padded."""
    width = max(len(r.prompt) + len(r.reply) for r in replays)
    ids = torch.full((len(replays), width), pad_id_of(target), dtype=torch.long)
    mask = torch.zeros((len(replays), width), dtype=torch.long)
    for row, r in enumerate(replays):
        sequence = r.prompt + r.reply
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    ids, mask = ids.to(target.device), mask.to(target.device)
    out = target(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    states = {i: h for i, h in enumerate(out.hidden_states[1:])}  # HF's index 0 is the embeddings
    return Rows(states, ids, [Span(row, len(r.prompt), r.reply) for row, r in enumerate(replays)])


# ---- each proposer's drafts at every point of a reply -------------------------------------------

@torch.inference_mode()
def chain_matches(drafter: Eagle3Drafter, rows: Rows, steps: int) -> list[list[int]]:
    """Per span, m_i for every point i: the EAGLE-3 chain of ``steps`` drafts at index start + i - 1 (the
    target's state there paired with r_i, as ``extend`` pairs the newest verified position)."""
    aux = rows.aux(drafter.config.layer_ids).to(drafter.fc.weight.dtype)
    outputs = ttt_unroll(drafter, rows.ids, aux, steps)  # steps x (B, L, H)
    found = []
    for span in rows.spans:
        at = slice(span.start - 1, span.start - 1 + span.states)
        drafts = torch.stack([drafter.to_target_ids(drafter.logits(h[span.row, at]).argmax(-1)) for h in outputs], dim=-1)
        found.append([leading_matches(d, span.reply, i) for i, d in enumerate(drafts.tolist())])  # (states, steps)
    return found


@torch.inference_mode()
def block_matches(drafter: DFlashDrafter, rows: Rows, k: int) -> list[list[int]]:
    """Per span, m_i for every point i: the DFlash block of ``k`` mask slots anchored at r_i (index start + i),
    which sees the context before it, as ``BatchBlockProposer.propose`` drafts it."""
    b, length = rows.ids.shape
    device = rows.ids.device
    positions = torch.arange(length, device=device)
    context = drafter.context(rows.aux(drafter.config.layer_ids).to(drafter.fc.weight.dtype), positions.expand(b, length))
    per_row = [sum(s.states for s in rows.spans if s.row == row) for row in range(b)]
    starts = torch.zeros((b, max(max(per_row), 1)), dtype=torch.long, device=device)
    first_anchor, filled = [], [0] * b  # each span's first anchor slot in its row
    for span in rows.spans:
        first_anchor.append(filled[span.row])
        starts[span.row, filled[span.row]: filled[span.row] + span.states] = span.start + torch.arange(span.states, device=device)
        filled[span.row] += span.states
    sees_context = positions[None, None, :] < starts[:, :, None]  # (B, A, L); an unused anchor at 0 sees none
    hidden = drafter.draft(rows.ids.gather(1, starts), starts, k + 1, context, sees_context)  # (B, A, k+1, H)
    drafts = drafter.to_target_ids(drafter.logits(hidden[:, :, 1:]).argmax(-1)).tolist()  # (B, A, k)
    return [[leading_matches(d, span.reply, i) for i, d in enumerate(drafts[span.row][a: a + span.states])]
            for span, a in zip(rows.spans, first_anchor)]


def lookup_matches(replay: Replay, steps: int, *, min_n: int, max_n: int) -> list[int]:
    """m_i for every point i of prompt lookup's proposal of up to ``steps`` tokens after prompt + r_0 .. r_i."""
    context = replay.prompt + replay.reply
    return [leading_matches(lookup_proposal(context[: len(replay.prompt) + i + 1], steps, min_n=min_n, max_n=max_n),
                            replay.reply, i) for i in range(replay.states)]


# ---- curves ---------------------------------------------------------------------------------------

@dataclass
class Counts:
    """Emitted tokens and passes at each k, summed over replies: one ``Tally`` a k, as the decodes are counted;
    and each reply's own (emitted, passes) at each k, in the order of the replies that have a point to draft
    at (``Replay.states``), the same order for every proposer of one ``one_pass_counts`` (what a paired margin
    between two proposers resamples)."""

    tallies: dict[int, Tally]
    replies: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, ks: Sequence[int]) -> Counts:
        return cls({k: Tally() for k in ks}, {k: [] for k in ks})

    @property
    def emitted(self) -> dict[int, int]:
        return {k: t.emitted for k, t in self.tallies.items()}

    @property
    def passes(self) -> dict[int, int]:
        return {k: t.passes for k, t in self.tallies.items()}

    def add(self, k: int, matches: Sequence[int]) -> None:
        counted = walk(matches, k)
        self.tallies[k].count(*counted)
        self.replies[k].append(counted)

    def curve(self) -> dict[str, float]:
        return {str(k): self.tallies[k].acceptance_length for k in sorted(self.tallies)}


def add_drafter(counts: Counts, drafter: TargetTied, rows: Rows) -> None:
    """Every span's walk at every k of ``counts``, the drafter's parts of ``rows`` sized to ``SCORE_ELEMENTS``."""
    ks, width = sorted(counts.tallies), rows.ids.shape[1]
    if isinstance(drafter, DFlashDrafter):
        heads = drafter.config.base.num_attention_heads
        for k in ks:
            slots = max([s.states for s in rows.spans], default=0) * (k + 1)
            for part in rows.parts(heads * slots * (width + slots)):
                for matches in block_matches(drafter, part, k):
                    counts.add(k, matches)
        return
    for part in rows.parts(drafter.config.num_attention_heads * width * width):
        for matches in chain_matches(drafter, part, max(ks)):
            for k in ks:
                counts.add(k, matches)


def add_lookup(counts: Counts, replays: Sequence[Replay], *, min_n: int, max_n: int) -> None:
    ks = sorted(counts.tallies)
    for replay in replays:
        if not replay.states:  # nothing to draft at (a drafter's pass skips it too): keeps ``replies`` aligned
            continue
        matches = lookup_matches(replay, max(ks), min_n=min_n, max_n=max_n)
        for k in ks:
            counts.add(k, matches)


def replay_batches(replays: Sequence[Replay], batch_tokens: int) -> list[list[Replay]]:
    """Consecutive batches whose rows times their longest sequence stay within ``batch_tokens`` (one row at least)."""
    batches: list[list[Replay]] = []
    current: list[Replay] = []
    longest = 0
    for r in replays:
        wider = max(longest, len(r.prompt) + len(r.reply))
        if current and (len(current) + 1) * wider > batch_tokens:
            batches.append(current)
            current, wider = [], len(r.prompt) + len(r.reply)
        current.append(r)
        longest = wider
    return [*batches, current] if current else batches


def one_pass_counts(target: object, replays: Sequence[Replay], drafters: Mapping[str, TargetTied], ks: Sequence[int],
                    *, batch_tokens: int, lookup: tuple[int, int] | None = None) -> dict[str, Counts]:
    """Emitted and passes at each k for every drafter (one target pass serves them all) and, with ``lookup``
    ((min_n, max_n)), prompt lookup under the name ``"lookup"``."""
    counts = {name: Counts.empty(ks) for name in drafters}
    if drafters:  # prompt lookup reads tokens alone: no target pass for it
        for batch in replay_batches([r for r in replays if r.states], batch_tokens):
            rows = target_pass(target, batch)
            for name, drafter in drafters.items():
                add_drafter(counts[name], drafter, rows)
            del rows
    if lookup is not None:
        counts["lookup"] = Counts.empty(ks)
        add_lookup(counts["lookup"], replays, min_n=lookup[0], max_n=lookup[1])
    return counts
