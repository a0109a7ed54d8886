"""A Llama-family target run over a KV cache of fixed slots, one request per slot: what continuous
batching needs from the model.

Hugging Face's forward with a ``DynamicCache`` grows and re-slices the cache every step, so a batch is
fixed for its whole decode and each step launches hundreds of small kernels from Python (on an H200 a
256-row step of SmolLM2-135M took 25 ms, almost all of it launch overhead). Here each layer's keys and
values live in one preallocated tensor of ``slots x slot_tokens`` positions, a request keeps its slot from
admission to its last token, and a decode step over rows ``0..n-1`` attends over their slots' first
``kv_len`` positions, hiding positions past each row's own. Every shape of a decode step is then fixed by
``(n, kv_len)``, so on CUDA the step is captured once per such bucket as a CUDA graph and replayed. On CUDA
a Triton kernel (``decode_attention``) reads each row's own positions instead, and ``n`` alone fixes a step.

The layers are the target's own modules (projections, norms, MLP, embedding, head); only attention and the
cache writes are ours. That holds for the pre-norm decoder of Llama, Mistral and Qwen2/Qwen3 with full
attention and a position-independent RoPE; any other target is refused (``UnsupportedTarget``) and the
server keeps the per-batch decoder for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.inference import decode_attention
from services.inference.decode_attention import slot_decode_attention
from services.inference.model import LoadedModel
from shared.errors import DraftlineError

log = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# RoPE types whose angle depends on the position alone, so one table of every position serves all steps.
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
MIN_KV_BUCKET = 256


class UnsupportedTarget(DraftlineError):
    """The target's architecture is not one the slot decoder runs."""

    permanent = True


def unsupported_reason(loaded: LoadedModel) -> str | None:
    """Why the slot decoder cannot run this target, or None when it can."""
    config = loaded.model.config
    if config.model_type not in SUPPORTED_TYPES:
        return f"model type {config.model_type!r} is not one of {sorted(SUPPORTED_TYPES)}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return "some layers use sliding-window attention"
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        return "Mistral's sliding window is set"
    rope = getattr(loaded.model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"RoPE type {rope!r} changes with the sequence length"
    return None


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * loaded.dtype.itemsize


def bucket(value: int, smallest: int, largest: int) -> int:
    """The smallest power of two times ``smallest`` that holds ``value``, at most ``largest``."""
    size = smallest
    while size < value:
        size *= 2
    return min(size, largest)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class GraphedStep:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (n, V), written by each replay


class SlotModel:
    """The target's forward over ``slots`` KV slots of ``slot_tokens`` positions each."""

    def __init__(self, loaded: LoadedModel, *, slots: int, slot_tokens: int, cuda_graphs: bool = True) -> None:
        reason = unsupported_reason(loaded)
        if reason is not None:
            raise UnsupportedTarget(f"the slot decoder cannot run {loaded.name}: {reason}")
        if slots < 1 or slot_tokens < 2:
            raise ValueError("the slot decoder needs at least one slot of at least two positions")
        self.loaded = loaded
        self.slots = slots
        self.slot_tokens = slot_tokens
        config = loaded.model.config
        self.inner = loaded.model.model
        self.head = loaded.model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        device, dtype = loaded.device, loaded.dtype
        with torch.inference_mode():
            shape = (slots, slot_tokens, self.kv_heads, self.head_dim)
            self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.inner.layers]
            self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.inner.layers]
            positions = torch.arange(slot_tokens, device=device)[None]
            probe = torch.zeros(1, device=device, dtype=dtype)
            cos, sin = self.inner.rotary_emb(probe, positions)  # (1, slot_tokens, head_dim) each
            self.cos, self.sin = cos[0], sin[0]
            # The decode step's inputs: graphs read these buffers, so a step copies its rows into them.
            self.step_ids = torch.zeros(slots, dtype=torch.long, device=device)
            self.step_positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        # The kernel reads each row's own positions; SDPA (CPU, or a head size the kernel does not take) reads
        # every row up to the step's kv_len.
        self.kernel = decode_attention.available(device) and self.head_dim in (16, 32, 64, 128, 256)
        self._graphs: dict[tuple[int, int], GraphedStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        log.info("slot decoder: %d slots of %d positions (%.2f GiB of KV cache), CUDA graphs %s, attention %s", slots,
                 slot_tokens, slots * slot_tokens * kv_bytes_per_token(loaded) / 2**30,
                 "on" if self.cuda_graphs else "off", "per-row kernel" if self.kernel else "SDPA")

    # -- the layers ------------------------------------------------------------------------------------

    def _project(self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor):
        """(q, k, v) of ``x`` (N, T, H): q (N, T, heads, d), k and v (N, T, kv_heads, d), RoPE applied."""
        attn = layer.self_attn
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, self.heads, self.head_dim)
        k = attn.k_proj(x).view(n, t, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(n, t, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # (N, T, 1, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        x = self.inner.embed_tokens(ids)
        for index, layer in enumerate(self.inner.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._project(layer, h, positions)
            out = attend(index, q, k, v)  # (N, T, heads * d)
            x = x + layer.self_attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.inner.norm(x)

    def _scale(self) -> float:
        return float(getattr(self.inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5))

    # -- prefill ---------------------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], slot_ids: list[int]) -> torch.Tensor:
        """Write each prompt's keys and values into its slot from position 0; the logits (B, V) after each
        prompt's last token. Prompts are right-padded: a causal mask alone keeps real tokens off the pads."""
        width = max(len(p) for p in prompts)
        if width > self.slot_tokens:
            raise ValueError(f"a prompt of {width} tokens does not fit a slot of {self.slot_tokens}")
        device = self.loaded.device
        ids = torch.full((len(prompts), width), self.loaded.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(device)
        positions = torch.arange(width, device=device)[None].expand(len(prompts), width)
        slots = torch.tensor(slot_ids, device=device)[:, None]
        scale = self._scale()

        def attend(index: int, q, k, v):
            self.keys[index][slots, positions] = k
            self.values[index][slots, positions] = v
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=scale, enable_gqa=self.group > 1)
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

        with torch.inference_mode():
            hidden = self._layers(ids, positions, attend)
            last = torch.tensor([len(p) - 1 for p in prompts], device=device)
            return self.head(hidden[torch.arange(len(prompts), device=device), last])

    # -- decode ----------------------------------------------------------------------------------------

    def _decode_eager(self, n: int, kv_len: int) -> torch.Tensor:
        """Logits (n, V) of rows 0..n-1 (slot i is row i) for ``step_ids``/``step_positions``, each row
        attending over its slot's positions up to its own, within the first ``kv_len``."""
        ids, positions = self.step_ids[:n, None], self.step_positions[:n, None]
        lengths = positions[:, 0] + 1  # what each row attends: its slot's positions up to its own
        if not self.kernel:
            seen = torch.arange(kv_len, device=ids.device)[None] <= positions  # (n, kv_len)
            mask = seen[:, None, None, :]  # (n, 1, 1, kv_len)
        slots = torch.arange(n, device=ids.device)[:, None]
        scale = self._scale()

        def attend(index: int, q, k, v):
            self.keys[index][slots, positions] = k
            self.values[index][slots, positions] = v
            # A query head group shares its key head: the group's queries become that head's query rows, so
            # no key is copied per query head.
            grouped = q.view(n, self.kv_heads, self.group, self.head_dim)
            if self.kernel:
                out = slot_decode_attention(grouped, self.keys[index], self.values[index], lengths, scale)
                return out.reshape(n, 1, self.heads * self.head_dim)
            keys = self.keys[index][:n, :kv_len].transpose(1, 2)  # (n, kv_heads, kv_len, d), a view
            values = self.values[index][:n, :kv_len].transpose(1, 2)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
            return out.reshape(n, 1, self.heads * self.head_dim)

        hidden = self._layers(ids, positions, attend)
        return self.head(hidden[:, 0])

    def decode(self, ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of rows 0..len(ids)-1 at its position; logits (n, V). Rows that hold no request
        pass any token at position 0: their slot is rewritten from 0 when a request takes it."""
        n = len(ids)
        # The kernel reads each row's length from memory: one graph serves every length.
        kv_len = 0 if self.kernel else bucket(max(positions) + 1, min(MIN_KV_BUCKET, self.slot_tokens),
                                              self.slot_tokens)
        rows = bucket(n, 1, self.slots) if self.cuda_graphs else n
        with torch.inference_mode():
            self.step_ids[:n].copy_(torch.tensor(ids), non_blocking=True)
            self.step_positions[:n].copy_(torch.tensor(positions), non_blocking=True)
            if rows > n:
                self.step_positions[n:rows].zero_()
            if not self.cuda_graphs:
                return self._decode_eager(n, kv_len)
            return self._graphed(rows, kv_len).logits[:n]

    def capture(self) -> int:
        """Capture the decode step of every row bucket now (the server does at start, before any request):
        a capture costs a warm-up step and some memory, better spent before serving than in its first
        minutes. With the per-row kernel a bucket is a row count alone; without it, the first length bucket
        (longer ones are captured when met). Returns the graphs held."""
        if not self.cuda_graphs:
            return 0
        kv_len = 0 if self.kernel else min(MIN_KV_BUCKET, self.slot_tokens)
        rows = 1
        with torch.inference_mode():
            self.step_positions.zero_()
            while True:
                self._graphed(rows, kv_len)
                if rows >= self.slots:
                    break
                rows = min(2 * rows, self.slots)
        log.info("captured %d decode graphs (rows 1 to %d)", len(self._graphs), self.slots)
        return len(self._graphs)

    def _graphed(self, rows: int, kv_len: int) -> GraphedStep:
        key = (rows, kv_len)
        step = self._graphs.get(key)
        if step is None:
            # A warm-up run on a side stream first, as capture requires; it only rewrites the rows' own slots.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._decode_eager(rows, kv_len)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Thread-local: the hidden-state pipeline's thread goes on allocating and synchronising meanwhile,
            # which a global capture would refuse.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._decode_eager(rows, kv_len)
            step = self._graphs[key] = GraphedStep(graph, logits)
            log.debug("captured the decode step for %d rows over %d positions", rows, kv_len)
        step.graph.replay()
        return step
