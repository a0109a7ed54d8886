"""The DFlash drafter in one file: its config, its modules with shape comments, and the block-diffusion
training objective. It reads the same hidden-state files as the EAGLE-3 drafter (``model.py``): the three
auxiliary layers' states, the token ids, the loss mask, and the target's final states for the labels.

Shapes: B batch, L positions of a sample, A anchors (blocks) per sample, S block size, C context columns,
H drafter hidden, Ht target hidden, Vd draft vocabulary, nh/nkv query/key-value heads, hd head dim.

How it drafts (what vLLM 0.32's ``qwen3_dflash`` computes; docs/dflash.md has the source lines):

- **Context.** Every position the target has verified contributes ``c = hidden_norm(fc(aux))``, its three
  auxiliary states concatenated in ascending layer order and projected to H. Each decoder layer turns ``c``
  into a key ``k_norm(k_proj(c))`` (rotated to the position) and a value ``v_proj(c)``, with no input norm,
  no query and no MLP: the context only ever is attended to.
- **Block.** One drafter pass takes the target's newest token (the "anchor", at position p) followed by
  S - 1 mask slots at positions p+1 .. p+S-1, each the token ``mask_token_id``. Both read the target's own
  (frozen) embedding, as vLLM does when an export ships no ``mask_embedding.pt`` (a pickle file, which
  draftline neither writes nor reads); the mask id is one the training data never holds. Each layer is a
  pre-norm Qwen3 decoder layer (per-head q_norm and k_norm, RoPE, SiLU MLP); a block query sees every context
  position before p and every position of its own block (bidirectional; with ``causal`` only the block's
  earlier positions and itself).
- **Output.** Slot j (1 <= j <= S-1) predicts the token *at its own position* p + j, through ``norm`` and
  the drafter's ``lm_head`` over the draft vocabulary (``d2t`` maps a draft id to a target id, as EAGLE-3's).
  One pass drafts S - 1 tokens; vLLM's ``num_speculative_tokens`` is S - 1.

One ``k_norm`` weight serves every layer: vLLM's CPU build normalizes the context keys of all layers with
layer 0's weight (docs/dflash.md §7.1), so a drafter whose layers kept their own would be served otherwise
on the CPU than on a GPU. Sharing the weight makes both the same; the export writes it into every layer.

Training objective (``DFlashObjective``), for a sample x_0 .. x_{L-1}:

- Anchors: up to ``anchors`` positions a drawn at random (a fresh draw every step, seeded by step and
  sample) among the loss-masked positions with a successor stored (a reply token the target wrote, as a
  served anchor always is: the prefill's first token or a verification's correction).
- Block at anchor a: tokens [x_a, MASK x (S-1)] at positions a .. a+S-1, context = positions 0 .. a-1 (the
  anchor's own hidden state does not exist yet when it is drafted from).
- Loss of slot j: the cross-entropy of the drafter's distribution at position a+j against the target's
  distribution for that token (softmax of the target's head at position a+j-1, restricted to the draft
  vocabulary), counted when x_{a+j} is a loss-masked token, is stored (a+j < L), and the target's argmax
  has a draft id (or, with ``train.loss`` an LK loss, ``modeling.losses``'s acceptance loss over the same
  labels). Slot j's mean over the global batch is weighted by exp(-(j-1)/gamma) (DFlash's decay: the
  early slots decide how far acceptance gets). acc_j = share of loss-masked labels whose drafter argmax (as a
  target id) equals the target's argmax, out-of-vocabulary tokens counting as misses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modeling.fused import apply_rope
from modeling.losses import StepLoss
from modeling.eagle3 import MLP, DrafterConfig, RMSNorm, RotaryEmbedding, TargetTied, repeat_kv

METHOD = "dflash"


@dataclass(frozen=True)
class DFlashConfig:
    base: DrafterConfig  # widths, heads, vocabularies, RoPE and the target layers read: EAGLE-3's fields
    num_layers: int = 1
    block_size: int = 8  # anchor + block_size - 1 mask slots: vLLM's num_speculative_tokens = block_size - 1
    mask_token_id: int = 0  # the id vLLM's proposer writes into mask slots; they read the target's embedding of it
    causal: bool = False  # within a block: bidirectional (DFlash's default) or causal

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.block_size < 2:
            raise ValueError(f"a DFlash drafter needs at least 1 layer and a block of 2, not {self.num_layers} and {self.block_size}")
        if not 0 <= self.mask_token_id < self.base.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary of {self.base.vocab_size}")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.base.layer_ids

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["base"] = self.base.to_dict()
        data["method"] = METHOD
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        fields = {k: v for k, v in data.items() if k != "method"}
        return cls(**{**fields, "base": DrafterConfig(**fields["base"])})


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(j-1)/gamma) for the mask slots j = 1 .. block_size-1: (S-1,) float64."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float64) / gamma)


class BlockAttention(nn.Module):
    """Qwen3 attention whose keys and values come from two places: the context (projected from the target's
    states, no query) and the block itself."""

    def __init__(self, config: DrafterConfig, k_norm: RMSNorm) -> None:
        super().__init__()
        c = config
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = [k_norm]  # the drafter's one shared module, held outside this module's parameters

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) -> rotated keys and values, each (B, nkv, T, hd)."""
        b, t, _ = x.shape
        k = self.k_norm[0](self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                allowed: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) the block rows (every block of a sample, flattened), context keys/values (B, nkv, C, hd),
        allowed (B, T, C + T) which context columns and block rows each query sees -> (B, T, H)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)  # (B, nh, T, hd)
        k, v = self.keys_values(x, cos, sin)  # (B, nkv, T, hd)
        keys = torch.cat([context[0], k], dim=2)  # (B, nkv, C + T, hd)
        values = torch.cat([context[1], v], dim=2)
        groups = self.nh // self.nkv
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), repeat_kv(keys, groups), repeat_kv(values, groups),
                                             attn_mask=allowed[:, None])  # (B, nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class DFlashLayer(nn.Module):
    def __init__(self, config: DrafterConfig, k_norm: RMSNorm) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = BlockAttention(config, k_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                allowed: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, allowed)  # (B, T, H)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(TargetTied):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        c = config.base
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen; filled by load_embedding
        self.fc = nn.Linear(len(c.layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c, self.k_norm) for _ in range(config.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rope = RotaryEmbedding(c)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # target id = i + d2t[i]
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # (..., H) -> (..., Vd)

    def context(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the context: aux (B, C, nHt) at positions (B, C) ->
        num_layers x ((B, nkv, C, hd), (B, nkv, C, hd))."""
        c = self.hidden_norm(self.fc(aux))  # (B, C, H)
        cos, sin = self.rope(positions)
        return [layer.self_attn.keys_values(c, cos, sin) for layer in self.layers]

    def block_inputs(self, first_ids: torch.Tensor, width: int) -> torch.Tensor:
        """first_ids (B, A) -> (B, A, width, H): each block's anchor embedding, then the mask token's."""
        ids = torch.full((*first_ids.shape, width), self.config.mask_token_id, device=first_ids.device)
        ids[..., 0] = first_ids
        return self.embed_tokens(ids).to(self.fc.weight.dtype)  # a narrower stored table widens here

    def draft(self, first_ids: torch.Tensor, starts: torch.Tensor, width: int,
              context: list[tuple[torch.Tensor, torch.Tensor]], sees_context: torch.Tensor) -> torch.Tensor:
        """A blocks per row in one pass: anchors ``first_ids`` (B, A) at positions ``starts`` (B, A), each followed
        by width - 1 mask slots; ``sees_context`` (B, A, C) which context columns each block may see.
        Returns the final hidden states (B, A, width, H), before ``norm``."""
        b, a = first_ids.shape
        t = a * width
        h = self.block_inputs(first_ids, width).reshape(b, t, -1)  # (B, T, H)
        positions = (starts[:, :, None] + torch.arange(width, device=starts.device)).reshape(b, t)  # (B, T)
        cos, sin = self.rope(positions)
        blocks = torch.arange(t, device=h.device) // width  # (T,) each row's block
        within = blocks[:, None] == blocks[None, :]  # (T, T)
        if self.config.causal:
            within = within & (torch.arange(t, device=h.device)[:, None] >= torch.arange(t, device=h.device)[None, :])
        from_context = sees_context.repeat_interleave(width, dim=1)  # (B, T, C)
        allowed = torch.cat([from_context, within.expand(b, t, t)], dim=-1)  # (B, T, C + T)
        for layer, kv in zip(self.layers, context):
            h = layer(h, cos, sin, kv, allowed)
        return h.view(b, a, width, -1)

    def export_state(self) -> dict[str, torch.Tensor]:
        """The tensors vLLM's qwen3_dflash loads (docs/dflash.md §2), under its names, plus ``t2d`` (ours,
        for training again); the shared k_norm written into every layer."""
        state = {name: t for name, t in self.state_dict().items()
                 if not name.startswith(("embed_tokens.", "k_norm."))}
        for i in range(self.config.num_layers):
            state[f"layers.{i}.self_attn.k_norm.weight"] = self.k_norm.weight.detach().clone()
        return state


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, count: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct anchors per row among the loss-masked positions with a successor stored:
    (anchors (B, A), used (B, A) bool), A = min(count, L), ascending. Row i draws from ``seeds[i]`` alone, so a
    row's anchors do not depend on the rows beside it (a resumed step, or a step split over processes, trains
    the blocks one uninterrupted process would). An unused anchor slot holds position 0."""
    b, length = loss_mask.shape
    scores = torch.stack([torch.rand(length, generator=torch.Generator().manual_seed(seed)) for seed in seeds])
    scores = scores.to(loss_mask.device)  # (B, L)
    positions = torch.arange(length, device=loss_mask.device)
    valid = loss_mask & (positions[None, :] + 1 < lengths.to(loss_mask.device)[:, None])
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    top, anchors = scores.topk(min(count, length), dim=-1)  # (B, A)
    used = top >= 0
    anchors = torch.where(used, anchors, torch.zeros_like(anchors))
    order = torch.where(used, anchors, torch.full_like(anchors, length)).argsort(dim=-1)  # ascending, unused last
    return anchors.gather(1, order), used.gather(1, order)


class DFlashObjective(nn.Module):
    """One module call per step, so DDP can wrap it; returns this rank's sums as ``train.TTTObjective`` does:
    the masked loss sum of each mask slot (S-1,) with its graph (``loss``: the cross-entropy by default) and
    (3, S-1) counts (masked labels, argmax hits, loss-masked labels)."""

    def __init__(self, drafter: DFlashDrafter, anchors: int, gamma: float, loss: StepLoss = StepLoss()) -> None:
        super().__init__()
        self.drafter = drafter
        self.anchors = anchors
        self.gamma = gamma
        self.loss = loss  # train.loss and train.lk_eta

    def step_weights(self) -> torch.Tensor:
        return slot_weights(self.drafter.config.block_size, self.gamma)

    def forward(self, batch: Any, targets: Any, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        d, width = self.drafter, self.drafter.config.block_size
        b, length = batch.input_ids.shape
        device = batch.input_ids.device
        anchors, used = sample_anchors(batch.loss_mask, batch.lengths, self.anchors, seeds)  # (B, A)
        positions = torch.arange(length, device=device)
        context = d.context(batch.aux_hidden, positions.expand(b, length))
        sees_context = positions[None, None, :] < anchors[:, :, None]  # (B, A, L): strictly before the anchor
        hidden = d.draft(batch.input_ids.gather(1, anchors), anchors, width, context, sees_context)  # (B, A, S, H)
        slots = anchors[:, :, None] + torch.arange(1, width, device=device)  # (B, A, S-1) each slot's position
        stored = (slots < batch.lengths.to(device)[:, None, None]) & used[:, :, None]
        at = slots.clamp(max=length - 1)
        learned = stored & batch.loss_mask.gather(1, at.flatten(1)).view_as(at)  # the label is a token it learns
        facts = (at - 1).flatten(1)  # (B, A*(S-1)): the target's facts for the token at each slot
        in_draft = targets.in_draft.gather(1, facts).view_as(at)
        argmax = targets.argmax.gather(1, facts).view_as(at)
        probs = targets.probs.gather(1, facts[..., None].expand(-1, -1, targets.probs.shape[-1]))
        probs = probs.view(*at.shape, -1)  # (B, A, S-1, Vd)
        mass = None if targets.draft_mass is None else targets.draft_mass.gather(1, facts).view_as(at)  # (B, A, S-1)
        logits = d.logits(hidden[:, :, 1:])  # (B, A, S-1, Vd)
        mask = learned & in_draft
        loss_sums, counts = [], []
        for j in range(width - 1):
            slot_mass = None if mass is None else mass[:, :, j]
            loss_sums.append(self.loss.masked_sum(logits[:, :, j], probs[:, :, j], slot_mass, mask[:, :, j]))
            with torch.no_grad():
                hit = d.to_target_ids(logits[:, :, j].argmax(-1)) == argmax[:, :, j]
                counts.append(torch.stack([mask[:, :, j].sum(), (hit & learned[:, :, j]).sum(), learned[:, :, j].sum()]))
        return torch.stack(loss_sums), torch.stack(counts, dim=1).float()


# DFlash's decay constants for the block sizes its paper trains (arXiv:2602.06036, Eq. 4); half the block otherwise.
PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, block_size / 2)
