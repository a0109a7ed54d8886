"""The DFlash block proposer (speculative_batch.BatchBlockProposer) on the real tiny target: it drafts what the
training pass computes for the same anchor, rows do not disturb each other, and every decode stays the
target's own greedy output."""

from __future__ import annotations

import pytest
import torch

from evaluation.lookup import NoProposer
from evaluation.speculative_batch import (
    BatchBlockProposer,
    RowProposers,
    Verified,
    drafter_proposer,
    prefill_batch,
    speculative_generate_batch,
)
from tests.support.tiny_runs import LAYER_IDS, demo_messages, prompt_ids

pytestmark = pytest.mark.dflash

MAX_NEW = 40


@pytest.fixture(scope="module")
def prompts(tiny_target, eval_messages) -> list[list[int]]:
    return [prompt_ids(tiny_target, m) for m in [*eval_messages, *demo_messages()[:4]]]


def batched(target, proposer, prompts, k):
    return speculative_generate_batch(target.model, proposer, prompts, max_new_tokens=MAX_NEW, draft_steps=k,
                                      layer_ids=LAYER_IDS)


def test_the_proposer_drafts_what_training_computes_at_the_same_anchor(trained_dflash, tiny_target, tiny_samples):
    d = trained_dflash
    ids = tiny_samples[0]["input_ids"]
    anchor = int(tiny_samples[0]["loss_mask"].nonzero()[3])  # a reply token, as every served anchor is
    full = prefill_batch(tiny_target.model, [ids.tolist()], LAYER_IDS).verified  # the target's states, one pass
    positions = torch.arange(ids.shape[0])[None]
    with torch.no_grad():
        context = d.context(full.aux, positions)
        starts = torch.tensor([[anchor]])
        hidden = d.draft(ids[None, anchor:anchor + 1], starts, d.config.block_size, context, positions[:, None] < anchor)
        trained = d.to_target_ids(d.logits(hidden[0, 0, 1:]).argmax(-1)).tolist()
    proposer = BatchBlockProposer(d)
    columns = slice(0, anchor)  # verified x_0 .. x_{a-1}; the newest token x_a follows the last of them
    proposer.extend(Verified(full.aux[:, columns], full.next_ids[:, columns], full.used[:, columns],
                             full.positions[:, columns], [full.tokens[0][columns]]))
    assert proposer.propose(d.config.block_size - 1) == [trained]
    assert int(full.next_ids[0, anchor - 1]) == int(ids[anchor])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_row_decodes_as_it_does_alone_and_as_greedy_decoding(k, trained_dflash, tiny_target, prompts):
    rows = batched(tiny_target, drafter_proposer(trained_dflash), prompts, k)
    plain = batched(tiny_target, RowProposers([NoProposer() for _ in prompts]), prompts, 1)
    assert [row.tokens for row in rows] == [row.tokens for row in plain]
    for ids, row in zip(prompts[:3], rows):
        alone = batched(tiny_target, BatchBlockProposer(trained_dflash), [ids], k)[0]
        assert (row.tokens, row.accepted) == (alone.tokens, alone.accepted)
    assert all(a <= k + 1 for row in rows for a in row.accepted)  # a pass yields k + 1 tokens at most
    if k > 1:
        assert any(a > 2 for row in rows for a in row.accepted)  # whole runs of drafts were taken from one pass


def test_the_evaluation_of_a_dflash_drafter_reports_its_method_and_block_curve(trained_dflash, tiny_target, eval_messages):
    from evaluation.evalsets import EvalPrompt
    from evaluation.evaluate import evaluate_prompts
    from shared.runspec import EvalConfig

    prompts = [EvalPrompt(100 + i, m) for i, m in enumerate([*eval_messages, *demo_messages()[:3]])]
    cfg = EvalConfig(max_new_tokens=MAX_NEW, draft_steps=3, curve_max_steps=3)
    report = evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_dflash, prompts, cfg)
    assert report["drafter_method"] == "dflash"
    curve = report["methods"]["drafter"]["curve"]
    assert sorted(curve) == ["1", "2", "3"] and curve["3"] > curve["1"] > 1.0  # a block of 3 yields more than 1
    assert report["greedy_check"]["checked"] == report["greedy_check"]["matched"] > 0
