"""The EAGLE-3 drafter in one file: a config dataclass and small ``nn.Module``s with shape comments.

Shapes: B batch, T positions, H drafter hidden, Ht target hidden, V target vocabulary, Vd draft vocabulary,
nh query heads, nkv key/value heads, hd head dim.

Parameter names are the export keys of EAGLE3.md (``midlayer.self_attn.q_proj.weight``, ``fc.weight``,
``lm_head.weight``, ``d2t``, ``t2d`` ...), so a state dict minus ``embed_tokens`` *is* the checkpoint.

With ``aux_norm`` (EAGLE-3.1's normalized features, the export's ``fc_norm``) each of the three auxiliary
states gets its own RMSNorm before ``fc`` (``fc_norm.0/1/2.weight``), as vLLM's and SGLang's
``combine_hidden_states`` / ``LlamaModel.forward`` apply it; everything after ``fc`` is unchanged.

The drafter runs in two modes that share every module and differ only in which keys a query sees:
``KVCache`` (evaluation: a plain causal cache over the sequence) and ``TTTCache`` (training-time test:
step k attends to step 0's keys causally plus the keys of steps 1..k at its own index; see train.py).
The elementwise functions (RMSNorm, RoPE, SiLU times up) live in ``fused``, compiled where training runs
on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shared.drafter_format import AUX_LAYERS
from shared.errors import UnsupportedRopeScaling
from modeling.fused import apply_rope, rms_norm, silu_mul


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    layer_ids: tuple[int, ...] = field(default=())  # auxiliary target layers, decoder_output_0idx convention
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: dict[str, Any] | None = None  # as config.json writes it: {"rope_type": ..., params}; None is plain RoPE
    aux_norm: bool = False  # EAGLE-3.1: each auxiliary layer's state RMS-normed before fc (the export's fc_norm)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} heads do not split into {self.num_key_value_heads} kv groups")
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        object.__setattr__(self, "rope_scaling", dict(self.rope_scaling) if self.rope_scaling else None)

    @classmethod
    def from_target_config(
        cls, target: dict[str, Any], *, draft_vocab_size: int, layer_ids: list[int], **overrides: Any
    ) -> DrafterConfig:
        """Derive the drafter from the target's ``config.json``: one decoder layer of the target's width.

        ``draft_vocab_size`` is capped at the target vocabulary; ``overrides`` replace any derived field
        (a published drafter may use fewer kv heads than its target, say).
        """
        text = target.get("text_config") or target  # multimodal targets nest the language model's config
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        vocab = int(text["vocab_size"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        if text.get("kv_lora_rank"):
            # An MLA target (DeepSeek-V3, Kimi-K2) caches one latent per token and up-projects every head's
            # own key and value from it, so its config says num_key_value_heads == num_attention_heads; the
            # drafter stays a plain GQA layer and takes both as they are (an override picks fewer kv heads).
            # Its head_dim is v_head_dim, the width of each head's output that the target's o_proj reads (128
            # for both models, as in the published Kimi-K2 drafters' configs). The config's own head_dim is not
            # a head's width here: transformers' DeepseekV3Config writes qk_rope_head_dim there (64), and
            # configs saved without it would give hidden // heads (112 for Kimi-K2).
            head_dim = int(text.get("v_head_dim") or head_dim)
        derived = dict(
            hidden_size=hidden,
            target_hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=min(int(draft_vocab_size), vocab),
            layer_ids=tuple(layer_ids),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(text),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            rope_scaling=rope_scaling_of(text),
        )
        derived.update(overrides)
        return cls(**derived)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_ids"] = list(self.layer_ids)
        return data


def rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE block of a config: ``rope_scaling`` (transformers 4, what the engines read) or
    ``rope_parameters`` (transformers 5); of a per-layer-type block, the full-attention layers' entry."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return dict(params)


def rope_theta_of(config: dict[str, Any]) -> float:
    """``rope_theta`` from a config in either the flat (transformers 4) or ``rope_parameters`` (5) style."""
    if "rope_theta" in config:
        return float(config["rope_theta"])
    return float(rope_params(config).get("rope_theta", 10000.0))


# RoPE types the drafter computes with transformers' own ROPE_INIT_FUNCTIONS, which vLLM and SGLang match.
# "mrope" rotates text positions exactly as plain RoPE (all three position components are equal), and the
# engines' Llama drafter takes it as such.
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn")
PLAIN_ROPE_TYPES = ("default", "mrope")


def rope_scaling_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """A config's RoPE scaling as the export writes it, ``{"rope_type": ..., <params>}`` without
    ``rope_theta`` (a field of its own); None for plain RoPE. UnsupportedRopeScaling for any other type."""
    params = rope_params(config)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("rope_theta", None)
    if kind in PLAIN_ROPE_TYPES:
        return None
    if kind not in SCALED_ROPE_TYPES:
        raise UnsupportedRopeScaling(f"rope_scaling type {kind!r}: the drafter computes {list(SCALED_ROPE_TYPES)} "
                                     "and plain RoPE only")
    return {"rope_type": kind, **params}


def rope_frequencies(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq (hd/2,), attention_scaling)``: plain RoPE, or transformers' own computation for a
    LlamaConfig of the same fields, so the rotation at train time is the one the engines apply."""
    if config.rope_scaling is None:
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        return inv_freq, 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                        max_position_embeddings=config.max_position_embeddings, rope_theta=config.rope_theta,
                        rope_scaling=dict(config.rope_scaling))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_scaling["rope_type"]](llama, None)
    return inv_freq.float(), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every norm's output goes straight into matmuls. Under autocast they would each round it to bf16 and
        # cast their gradient back: rounding inside the norm's kernel gives them the same values in one
        # half-size tensor (bench/RESULTS.md, the trainer profile's casts).
        device = x.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else torch.promote_types(self.weight.dtype, x.dtype))
        return rms_norm(x, self.weight, self.eps, dtype)  # float32 normalization, scaled in the input dtype


class RotaryEmbedding(nn.Module):
    """Llama RoPE (rotate-half layout, what vLLM and SGLang use for ``LlamaForCausalLMEagle3``), with the
    config's scaling: scaled frequencies, and YaRN's attention factor on cos and sin as the engines apply it."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(config)  # (hd/2,), float
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # (B, T, hd/2)
        angles = torch.cat([freqs, freqs], dim=-1)  # (B, T, hd)
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos[:, None], sin[:, None]  # (B, 1, T, hd) each


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # (B, nkv, T, hd) -> (B, nh, T, hd)


class AttentionCache(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this call's keys/values and return attention output (B, nh, T, hd)."""


class KVCache:
    """Evaluation: keys/values in sequence order; new queries see everything before them and themselves."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, nkv, S, hd)
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # (B, nkv, past+T, hd)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        groups = q.shape[1] // k.shape[1]
        t, s = q.shape[2], self.length
        allowed = torch.arange(s, device=q.device)[None, :] <= past + torch.arange(t, device=q.device)[:, None]  # (T, S)
        return F.scaled_dot_product_attention(q, repeat_kv(self.k, groups), repeat_kv(self.v, groups), attn_mask=allowed)

    def crop(self, length: int) -> None:
        """Forget every entry from ``length`` on (draft-chain entries after a verification step)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class MaskedKVCache:
    """Evaluation of many sequences at once: keys/values (B, nkv, S, hd) in column order and which columns hold a
    position of their row's sequence (B, S). Rows grow by the same number of columns per call; a column a row
    does not use (a rejected draft, left padding) stays masked instead of being cut. A query sees its row's
    used columns up to itself, and always itself, so a query at an unused column never meets an empty row."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, nkv, S, hd)
        self.v: torch.Tensor | None = None
        self.used: torch.Tensor | None = None  # (B, S) bool
        self.incoming: torch.Tensor | None = None  # (B, T) bool: which of the next call's columns count; None: all

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, past = q.shape[0], q.shape[2], self.length
        incoming = self.incoming if self.incoming is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
        self.incoming = None
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # (B, nkv, past+T, hd)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.used = incoming if self.used is None else torch.cat([self.used, incoming], dim=1)  # (B, past+T)
        columns = torch.arange(self.length, device=q.device)[None, :]  # (1, S)
        rows = past + torch.arange(t, device=q.device)[:, None]  # (T, 1)
        allowed = (self.used[:, None, :] & (columns <= rows)[None]) | (columns == rows)[None]  # (B, T, S)
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(self.k, groups), repeat_kv(self.v, groups),
                                              attn_mask=allowed[:, None])

    def crop(self, length: int) -> None:
        """Forget every column from ``length`` on (the draft chain's, after a proposal)."""
        if self.k is not None:
            self.k, self.v, self.used = self.k[:, :, :length], self.v[:, :, :length], self.used[:, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
        if self.k is not None:
            self.k, self.v, self.used = self.k[rows], self.v[rows], self.used[rows]


class TTTCache:
    """Training-time test: the first call (step 0) attends causally over the whole sequence; step k's query
    at index t attends to step 0's keys at indices <= t and to the keys of steps 1..k at index t only.

    That is exactly what the query sees at serving time: the drafter's cache over the verified prefix,
    then the chain of its own earlier draft steps.

    With ``flex`` the steps after the first are one block-sparse flex-attention call each
    (``ttt_attention.chain_attention``, the CUDA path); without it, the dense form below, which computes the
    same function on any device and is the reference the tests hold the flex form to.
    """

    def __init__(self, flex: bool = False) -> None:
        self.flex = flex
        self.k0: torch.Tensor | None = None  # (B, nkv, T, hd) step 0
        self.v0: torch.Tensor | None = None
        self.chain: list[tuple[torch.Tensor, torch.Tensor]] = []  # steps 1..k, each (B, nkv, T, hd)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)
        self.chain.append((k, v))
        if self.flex:
            from modeling.ttt_attention import chain_attention

            return chain_attention(q, self.k0, self.v0, self.chain)
        scale = 1.0 / math.sqrt(q.shape[-1])
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        prefix = (q @ repeat_kv(self.k0, groups).transpose(-1, -2)) * scale  # (B, nh, T, T)
        prefix = prefix.masked_fill(~causal, float("-inf"))
        diagonal = [(q * repeat_kv(ck, groups)).sum(-1, keepdim=True) * scale for ck, _ in self.chain]  # k x (B, nh, T, 1)
        weights = torch.cat([prefix, *diagonal], dim=-1).float().softmax(dim=-1).to(q.dtype)  # (B, nh, T, T+k)
        out = weights[..., :t] @ repeat_kv(self.v0, groups)  # (B, nh, T, hd)
        for j, (_, cv) in enumerate(self.chain):
            out = out + weights[..., t + j : t + j + 1] * repeat_kv(cv, groups)
        return out


def shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """``out[:, t] = x[:, t + s]``, zero (False) past the end: (B, L, ...) -> (B, L, ...)."""
    out = torch.zeros_like(x)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def ttt_unroll(drafter: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int, *,
               flex: bool = False) -> list[torch.Tensor]:
    """The training-time-test unroll (train.py's alignment table): step k's output at every index,
    ``steps`` x (B, L, H). Step 0 pairs the target's state at t with x_{t+1} at position t; step k feeds
    back step k-1's output with x_{t+1+k} at position t + k, under ``TTTCache``'s attention."""
    b, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(b, length)  # (B, L)
    hidden = drafter.fuse(aux_hidden)  # (B, L, H)
    cache, outputs = TTTCache(flex=flex), []
    for k in range(steps):
        hidden = drafter(hidden, shift(input_ids, k + 1), positions + k, cache)  # (B, L, H)
        outputs.append(hidden)
    return outputs


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c = config
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.rope = RotaryEmbedding(c)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        b, t, _ = x.shape  # x: (B, T, 2H)
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = self.rope(positions)
        out = cache.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # (B, nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))  # (B, T, H)


class MidLayer(nn.Module):
    """The one decoder layer: token embedding and hidden state, each normed, concatenated (embedding
    first, as vLLM and SGLang do) into q/k/v; the residual stream starts from the un-normed hidden state."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        h = hidden + self.self_attn(x, positions, cache)  # (B, T, H)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H), before the final norm


class TargetTied(nn.Module):
    """What every drafter shares with its target: the frozen embedding table (``embed_tokens``) and the draft
    vocabulary's mapping to target ids (``d2t``, ``t2d`` buffers); the subclass creates all three."""

    def load_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(weight.shape)} does not fit the drafter {tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def store_embedding_as(self, dtype: torch.dtype) -> None:
        """Keep the frozen embedding table in ``dtype`` (the target's own, when narrower than the weights):
        lookups widen to the weights' dtype, so a bf16 target's table trains exactly as a float32 copy of
        it would, in half the memory (1 GB less at a 128k vocabulary and hidden 4,096)."""
        if dtype.itemsize < self.embed_tokens.weight.dtype.itemsize:
            self.embed_tokens.to(dtype)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a training checkpoint keeps: every tensor under its module name, but the frozen embedding."""
        return {name: t for name, t in self.state_dict().items() if not name.startswith("embed_tokens.")}


class Eagle3Drafter(TargetTied):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen; filled by load_embedding
        if config.aux_norm:  # only where asked: a norm the export does not declare would not be served
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(AUX_LAYERS))
        self.fc = nn.Linear(AUX_LAYERS * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # target id = i + d2t[i]
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))  # target id is in the draft vocab

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary states (B, T, 3Ht) as the drafter's input hidden state (B, T, H)."""
        if self.config.aux_norm:
            chunks = aux_hidden.chunk(AUX_LAYERS, dim=-1)  # 3 x (B, T, Ht), low to high
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)  # (B, T, 3Ht)
        return self.fc(aux_hidden)  # (B, T, 3Ht) -> (B, T, H)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """One drafter pass: ``hidden`` (B, T, H) paired with the embedding of ``token_ids`` (B, T) at
        ``positions`` (B, T); returns the pre-norm hidden state (B, T, H) that the next step feeds back."""
        embeds = self.embed_tokens(token_ids).to(self.fc.weight.dtype)  # (B, T, H); a narrower stored table widens here
        return self.midlayer(embeds, hidden, positions, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # (B, T, H) -> (B, T, Vd)

    def export_state(self) -> dict[str, torch.Tensor]:
        """The exported tensors: the checkpoint's, under the names the engines load."""
        return self.checkpoint_state()
