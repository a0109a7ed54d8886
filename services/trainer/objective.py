"""What a training step optimizes: the target's next-token facts at every position, and the EAGLE-3 training-time
test (TTT) objective over them. DFlash's block objective lives with its drafter (``modeling/dflash.py``).

Alignment (one sample of tokens x_0..x_{L-1}; the target's aux states f_t and final-norm states g_t at
position t have seen x_0..x_t, and softmax(lm_head(g_t)) is the target's distribution for x_{t+1}):

    step k, index t      input hidden   input token   RoPE position   predicts   target distribution
    0                    fc(f_t)        x_{t+1}       t               x_{t+2}    softmax(lm_head(g_{t+1}))
    k >= 1               out_{k-1}[t]   x_{t+1+k}     t + k           x_{t+2+k}  softmax(lm_head(g_{t+1+k}))

- Step 0 pairs the target's state at t with the *next* token, as vLLM's proposer does (it shifts the
  token ids left by one and puts the target's freshly sampled token last).
- Step k >= 1 feeds back step k-1's output at the same index (the pre-norm hidden state, as the engines
  feed back), with the teacher-forced token; the chain at index t is the draft the serving engine makes
  after the target has verified x_0..x_{t+1}. Positions advance by one per step (vLLM: ``positions += 1``).
- Attention: step k's query at index t sees step 0's keys at indices <= t (the drafter's cache over the
  verified prefix) and the keys of steps 1..k at index t (its own chain), as in SpecForge's cache_hidden
  attention. The older EAGLE code that also masked step 0's diagonals hid valid context (SafeAILab/EAGLE
  PR #299); we do not.
- Loss of step k at index t counts when the predicted token x_{t+2+k} is loss-masked (a token the
  drafter learns: ``loss_mask[t+2+k]``, the mask of the label, never of the input token x_{t+1+k}) and
  the target's argmax at t+1+k lies in the draft vocabulary. It is the cross-entropy
  of the drafter's distribution against the target's softmax restricted to the draft vocabulary
  (``train.loss: kl``), or an LK loss on the chance that the target accepts the drafted token
  (``lk_lambda``, ``lk_alpha``; ``modeling.losses``), over the same positions; total = sum_k 0.8^k L_k.
  A position whose target argmax has no draft id stays out of every loss: greedy verification never
  accepts a draft there, whatever the drafter learns. Within the counted positions the LK losses take the
  target's true probabilities, its mass outside the draft vocabulary included as lost acceptance
  (``Targets.draft_mass``). acc_k = share of loss-masked predictions whose drafter argmax (as a target id)
  equals the target's argmax, counted over all masked positions, so tokens outside the draft vocabulary
  count as misses, as they do at serving time.

At the prompt/reply boundary (prompt x_0..x_{P-1}, first reply token x_P): a prompt token is never a
label (its mask is 0), so no step learns to predict the prompt. The first reply token's target
distribution is the last prompt position's, softmax(lm_head(g_{P-1})), and step 0 learns it at index
P-2, from f_{P-2} and the last prompt token x_{P-1}. Serving never drafts x_P (the target's prefill
samples it): the first draft is step 0 at index P-1, from f_{P-1} and x_P, predicting x_{P+1}, which is
what ``evaluate.DrafterProposer`` feeds (``extend`` pairs position p with x_{p+1}, the target's newest
token last) and what vLLM's EAGLE proposer feeds. The k + 1 chains of step k that start inside the
prompt (indices P-2-k .. P-2) are trained though never served; they are a few positions per reply.
The last k + 2 indices of a sample have no label at step k (x_L is not stored).
tests/services/trainer/test_alignment.py pins both: which mask entries gate which loss positions, and
that training's step-k logits at index t equal the proposer's chain step k after verifying x_0..x_{t+1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modeling.eagle3 import Eagle3Drafter, ttt_unroll
from modeling.losses import StepLoss
from modeling.target_head import target_logits
from services.trainer.data import Batch
from services.trainer.vocab import draft_to_target

STEP_DECAY = 0.8
TARGET_CHUNK = 1024  # positions per target-logit product: (chunk, V) at a time, not (B, L, V) in float32


@dataclass
class Targets:
    probs: torch.Tensor  # (B, L, Vd) target softmax over the draft vocabulary, at each position
    argmax: torch.Tensor  # (B, L) the target's greedy next token (target id)
    in_draft: torch.Tensor  # (B, L) bool, that token has a draft id
    draft_mass: torch.Tensor | None = None  # (B, L) the target's probability on the draft vocabulary; None: 1


@torch.no_grad()
def make_targets(batch: Batch, lm_head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> Targets:
    """The target's next-token facts at every position, ``TARGET_CHUNK`` positions at a time: a (B, L, V)
    float32 product of a 128k vocabulary is 2 GiB at L = 4,096, the largest tensor of a step otherwise."""
    b, length, _ = batch.last_hidden.shape
    hidden = batch.last_hidden.reshape(b * length, -1)  # (B*L, H)
    columns = draft_to_target(d2t)  # (Vd,) target ids of the draft vocabulary
    probs = torch.empty(b * length, columns.shape[0], dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(b * length, dtype=torch.long, device=hidden.device)
    mass = torch.empty(b * length, dtype=torch.float32, device=hidden.device)
    for start in range(0, b * length, TARGET_CHUNK):
        rows = slice(start, start + TARGET_CHUNK)
        logits = target_logits(lm_head, hidden[rows])  # (chunk, V) float32, exact copies of the head's dtype
        argmax[rows] = logits.argmax(-1)
        drafted = logits[:, columns]  # (chunk, Vd)
        probs[rows] = drafted.softmax(-1)
        mass[rows] = (drafted.logsumexp(-1) - logits.logsumexp(-1)).exp()  # (chunk,) share of the softmax on Vd
    argmax = argmax.view(b, length)
    return Targets(probs=probs.view(b, length, -1), argmax=argmax, in_draft=t2d[argmax],
                   draft_mass=mass.view(b, length))


class TTTObjective(nn.Module):
    """The whole unroll as one module call, so DDP can wrap it.

    Returns this rank's sums, which the training step turns into means over the global batch: the masked
    loss sum of each step (K,) with its graph (``loss``: the cross-entropy by default), and (3, K) counts
    without one: masked positions, argmax hits and loss-masked predictions per step.

    Step k's loss at index t needs the label x_{t+2+k}, so only the first L - k - 2 indices have one; the
    logits and the loss are computed over those, against views of the targets shifted by k + 1 (no copy),
    and ``modeling.losses`` keeps only the logits for the backward.
    """

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, flex: bool = False, loss: StepLoss = StepLoss()) -> None:
        super().__init__()
        self.drafter = drafter
        self.ttt_steps = ttt_steps
        self.flex = flex  # ttt_attention's block-sparse form of the chain steps' attention (CUDA)
        self.loss = loss  # train.loss and train.lk_eta

    def unroll(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor) -> list[torch.Tensor]:
        """Step k's output at every index: ``ttt_steps`` x (B, L, H), aligned as the module doc says."""
        return ttt_unroll(self.drafter, input_ids, aux_hidden, self.ttt_steps, flex=self.flex)

    def step_weights(self) -> torch.Tensor:
        return STEP_DECAY ** torch.arange(self.ttt_steps, dtype=torch.float64)  # total = sum_k 0.8^k L_k

    def forward(self, batch: Batch, targets: Targets, seeds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seeds  # the unroll draws nothing at random (DFlashObjective's anchors do)
        d = self.drafter
        length = batch.input_ids.shape[1]
        loss_sums, counts = [], []
        for k, hidden in enumerate(self.unroll(batch.input_ids, batch.aux_hidden)):
            n = max(length - k - 2, 0)  # indices t whose label x_{t+2+k} is stored
            labelled = slice(k + 1, k + 1 + n)  # the target's facts at t+1+k, whose next token is that label
            learned = batch.loss_mask[:, k + 2 : k + 2 + n]  # (B, n): the label is a token the drafter learns
            mask = learned & targets.in_draft[:, labelled]
            logits = d.logits(hidden[:, :n])  # (B, n, Vd)
            mass = None if targets.draft_mass is None else targets.draft_mass[:, labelled]  # (B, n)
            loss_sums.append(self.loss.masked_sum(logits, targets.probs[:, labelled], mass, mask))
            with torch.no_grad():
                hit = d.to_target_ids(logits.argmax(-1)) == targets.argmax[:, labelled]  # (B, n)
                counts.append(torch.stack([mask.sum(), (hit & learned).sum(), learned.sum()]))
        return torch.stack(loss_sums), torch.stack(counts, dim=1).float()  # (K,), (3, K)


def objective_of(objective: nn.Module) -> nn.Module:
    """The objective a step calls, unwrapped from DDP where a multi-process run wrapped it."""
    return objective.module if isinstance(objective, nn.parallel.DistributedDataParallel) else objective
