"""Training matches serving: which loss-mask entry gates which prediction, and the (state, token, label)
pairing of training against what the serving-time proposer feeds (see train.py's module doc).

The convention: at position p the drafter takes the target's aux state f_p and the token x_{p+1} and
predicts x_{p+2}, whose target distribution is softmax(lm_head(g_{p+1})); the loss at p counts when
x_{p+2} is a token to learn, loss_mask[p+2] = 1.
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.data import collate
from evaluation.speculative import DrafterProposer, aux_states
from modeling.eagle3 import DrafterConfig, Eagle3Drafter
from modeling.target_head import load_target_head, read_target_config
from services.trainer.objective import Targets, TTTObjective, make_targets
from shared import eagle3
from tests.support.tiny_runs import LAYER_IDS, TinyTarget, prompt_ids

STEPS = 3
# A hand-made two-turn sample: prompt (0..4), reply (5..8), a user turn (9..11), reply (12..14), and a
# trailing template token (15) that is not learned.
MASK = [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]


def full_vocab_drafter(target: TinyTarget, seed: int = 0) -> Eagle3Drafter:
    """A random drafter whose draft vocabulary is the whole target vocabulary (identity mapping), so
    every label is in it unless a test takes one out."""
    torch.manual_seed(seed)
    config = DrafterConfig.from_target_config(read_target_config(target.model_dir), draft_vocab_size=10**9, layer_ids=LAYER_IDS)
    drafter = Eagle3Drafter(config)
    drafter.load_embedding(load_target_head(target.model_dir).embed)
    drafter.set_vocab_mapping(torch.zeros(config.vocab_size, dtype=torch.long), torch.ones(config.vocab_size, dtype=torch.bool))
    return drafter.eval()


@torch.no_grad()
def target_states(target: TinyTarget, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux states (L, 3H) and final-norm states (L, H) over ``ids``, as extraction stores them."""
    out = target.model(ids[None], output_hidden_states=True)
    return aux_states(out.hidden_states, LAYER_IDS), out.hidden_states[-1][0]


def hand_made_batch(target: TinyTarget):
    ids = torch.tensor(prompt_ids(target, [{"role": "user", "content": "Name a colour."}])[: len(MASK)])
    assert ids.shape[0] == len(MASK)
    aux, last = target_states(target, ids)
    return collate([{eagle3.INPUT_IDS: ids, eagle3.LOSS_MASK: torch.tensor(MASK, dtype=torch.uint8),
                     eagle3.AUX_HIDDEN: aux, eagle3.LAST_HIDDEN: last}])


@pytest.mark.parametrize("drop_label", [None, 6])
def test_exactly_the_predictions_of_loss_masked_tokens_are_trained_each_against_its_own_target(tiny_target, drop_label):
    """Step k at index t predicts x_{t+2+k}: its loss counts iff MASK[t+2+k] = 1 (and the target's argmax
    at t+1+k is in the draft vocabulary), and it is the cross-entropy against the target's distribution
    at t+1+k. Read from the gradient of each step's loss with respect to the target distributions."""
    drafter, batch = full_vocab_drafter(tiny_target), hand_made_batch(tiny_target)
    lm_head = load_target_head(tiny_target.model_dir).lm_head
    made = make_targets(batch, lm_head, drafter.d2t, drafter.t2d)
    if drop_label is not None:  # take the target's argmax for label x_6 out of the draft vocabulary
        drafter.t2d[made.argmax[0, drop_label - 1]] = False
        made = make_targets(batch, lm_head, drafter.d2t, drafter.t2d)
    probs = made.probs.clone().requires_grad_(True)  # (1, L, Vd): the target distribution at each position
    objective = TTTObjective(drafter, STEPS)
    ce_sums, counts = objective(batch, Targets(probs, made.argmax, made.in_draft))
    logp = [drafter.logits(h).float().log_softmax(-1) for h in objective.unroll(batch.input_ids, batch.aux_hidden)]
    length = len(MASK)
    for k in range(STEPS):
        (grad,) = torch.autograd.grad(ce_sums[k], probs, retain_graph=True)  # (1, L, Vd)
        used = [j for j in range(length) if grad[0, j].abs().sum() > 0]  # target distributions this step learns from
        labels = [j + 1 for j in used]  # the distribution at j is the target's for x_{j+1}
        expected = [p for p in range(k + 2, length) if MASK[p] and bool(made.in_draft[0, p - 1])]
        assert labels == expected, f"step {k}"
        for j in used:  # the distribution at j meets the drafter's prediction at index t = j - 1 - k
            torch.testing.assert_close(grad[0, j], -logp[k][0, j - 1 - k].detach())
        learned = [p for p in range(k + 2, length) if MASK[p]]
        assert counts[:, k].tolist() == [len(expected), counts[1, k].item(), len(learned)]
    assert 5 in [p for p in range(2, length) if MASK[p]]  # the first reply token is learned at step 0 ...
    assert not {9, 10, 11, 15} & set(expected)  # ... and no prompt or template token is ever a label
    if drop_label is not None:
        assert drop_label in [p for p in range(2, length) if MASK[p]] and drop_label not in expected


@torch.no_grad()
def chain_against_training(tiny_target, drafter) -> tuple[list[int], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The proposer's chain after the target prefills a prompt and samples x_P, and training's unroll over the
    sequence it drafted: ``(prompt, aux states, the chain's logits per step, training's step outputs)``."""
    prompt = prompt_ids(tiny_target, [{"role": "user", "content": "Count to three."}])
    first = int(tiny_target.model(torch.tensor([prompt])).logits[0, -1].argmax())  # x_P, from the last prompt position
    p, prefill = len(prompt), target_states(tiny_target, torch.tensor(prompt))[0]  # (P, 3H)
    proposer, seen = DrafterProposer(drafter), []
    hook = drafter.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[0, -1].clone()))
    try:
        proposer.extend(prefill, [*prompt[1:], first])
        drafts = proposer.propose(STEPS)
    finally:
        hook.remove()
    sequence = torch.tensor([*prompt, first, *drafts])  # teacher forcing feeds what the chain fed
    # Index P-1 sees only states 0..P-1 (causal): the prefill's, so both sides read the same numbers.
    aux = torch.cat([prefill, target_states(tiny_target, sequence)[0][p:]])  # (L, 3H)
    return prompt, aux, seen, TTTObjective(drafter, STEPS).unroll(sequence[None], aux[None])  # STEPS x (1, L, H)


@torch.no_grad()
def test_training_logits_equal_the_proposers_chain_after_the_same_verified_prefix(tiny_target):
    """Serving: the target prefills prompt x_0..x_{P-1} and samples x_P; the proposer's ``extend`` pairs
    position p with x_{p+1} and its chain drafts x_{P+1}, x_{P+2}, ... Training on the sequence prompt,
    x_P and those drafts must give, at index t = P - 1, step k's logits equal to chain step k's."""
    drafter = full_vocab_drafter(tiny_target, seed=3)
    prompt, aux, seen, unrolled = chain_against_training(tiny_target, drafter)
    p = len(prompt)
    for k in range(STEPS):
        torch.testing.assert_close(drafter.logits(unrolled[k])[0, p - 1], seen[k], rtol=1e-4, atol=1e-5)
    # The pairing is what makes them equal: state p with token x_p (no shift) gives other logits.
    unshifted = DrafterProposer(drafter)
    unshifted.extend(aux[:p], prompt)
    assert not torch.allclose(drafter.logits(unshifted.last)[0, -1], seen[0], atol=1e-3)
