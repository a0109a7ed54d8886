"""Decode attention over KV slots that reads each row's own positions only (a Triton kernel, CUDA).

With one ``(n, kv_len)`` shape per step, attention through SDPA reads every row's slot up to the longest
row's length: on the H200 with 1,024 slots of mixed lengths (positions up to ~1,100, kv_len bucket 2,048)
a SmolLM2-135M step took 23 ms, about four times what the rows' real keys and values take to read
(bench/RESULTS.md, "Continuous batching"). Here one program per (row, key head) loops over its row's
positions in blocks with an online softmax, so a step reads what the rows hold. The lengths come from
device memory, so a CUDA graph of the step replays with each step's lengths.

A key head's query heads (GQA's group) are the program's query rows, padded to the 16 rows a tensor-core
product needs; keys and values are read once per group.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; SlotModel then keeps SDPA
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _slot_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lengths_ptr, scale,
                            stride_qn, stride_qh, stride_qg,
                            stride_kn, stride_kl, stride_kh,
                            stride_on, stride_oh, stride_og,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                            IEEE: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        length = tl.load(lengths_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM)
        q = tl.load(q_ptr + row * stride_qn + head * stride_qh + g[:, None] * stride_qg + d[None, :],
                    mask=g[:, None] < GROUP, other=0.0)
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        base = k_ptr + row * stride_kn + head * stride_kh
        vbase = v_ptr + row * stride_kn + head * stride_kh
        for start in range(0, length, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < length
            k = tl.load(base + offs[:, None] * stride_kl + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(inside[None, :], s * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, 1))
            p = tl.exp(s - new_best[:, None])
            alpha = tl.exp(best - new_best)
            v = tl.load(vbase + offs[:, None] * stride_kl + d[None, :], mask=inside[:, None], other=0.0)
            total = total * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_on + head * stride_oh + g[:, None] * stride_og + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUP)


def slot_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """q (n, kv_heads, group, d); keys/values the cache (slots, slot_tokens, kv_heads, d), row i in slot i;
    lengths (n,) the positions each row attends (its position + 1). Returns (n, kv_heads, group, d)."""
    n, kv_heads, group, dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    pad = max(16, triton.next_power_of_2(group))
    _slot_decode_kernel[(n, kv_heads)](
        q, keys, values, out, lengths, scale,
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, GROUP_PAD=pad, DIM=dim, BLOCK=64, IEEE=q.dtype == torch.float32,
    )
    return out
