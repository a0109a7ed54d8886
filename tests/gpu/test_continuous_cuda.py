"""The continuous decoder's CUDA paths for real: the per-row attention kernel against SDPA, and the graphed
slot decoder's logits against the model's own full forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.inference.continuous import ContinuousScheduler
from services.inference.decode import GenerationRequest, generate_batch
from services.inference.decode_attention import slot_decode_attention
from services.inference.slots import SlotModel
from tests.services.inference.test_decode import MAX_NEW, PROMPTS, chat_prompt_ids

pytestmark = pytest.mark.gpu


def reference(q, keys, values, lengths, scale):
    """SDPA over each row's first ``length`` positions, in float32."""
    out = []
    for row, length in enumerate(lengths.tolist()):
        k = keys[row, :length].transpose(0, 1).float()  # (kv_heads, L, d)
        v = values[row, :length].transpose(0, 1).float()
        out.append(F.scaled_dot_product_attention(q[row].float(), k, v, scale=scale))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (8, 4, 128), (2, 1, 64)])
def test_the_kernel_equals_attention_over_each_rows_own_positions(dtype, kv_heads, group, dim):
    torch.manual_seed(0)
    slots, slot_tokens, n = 12, 700, 9
    keys = torch.randn(slots, slot_tokens, kv_heads, dim, device="cuda", dtype=dtype)
    values = torch.randn_like(keys)
    q = torch.randn(n, kv_heads, group, dim, device="cuda", dtype=dtype)
    # Lengths across block edges (64), one row of a single position, one of the whole slot.
    lengths = torch.tensor([1, 63, 64, 65, 129, 300, 511, 640, 700], device="cuda", dtype=torch.long)
    scale = dim ** -0.5
    got = slot_decode_attention(q, keys, values, lengths, scale).float()
    want = reference(q, keys, values, lengths, scale)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    # Positions past a row's length do not count: changing them changes nothing.
    keys[0, 1:] = 1e4
    torch.testing.assert_close(slot_decode_attention(q, keys, values, lengths, scale).float()[0], got[0])


def test_graphed_slot_logits_equal_the_full_forward(loaded_tiny_cuda_fp32):
    loaded = loaded_tiny_cuda_fp32
    model = SlotModel(loaded, slots=4, slot_tokens=256, cuda_graphs=True)
    assert model.kernel and model.cuda_graphs
    prompts = chat_prompt_ids(loaded, PROMPTS[:3])
    with torch.inference_mode():
        tails = [generate_batch(loaded, [GenerationRequest(p, 10)])[0].token_ids for p in prompts]
        full = [loaded.model(torch.tensor([p + t], device="cuda")).logits[0] for p, t in zip(prompts, tails)]
        first = model.prefill(prompts, [0, 1, 3])
    for row, slot_prompt in enumerate(prompts):
        torch.testing.assert_close(first[row], full[row][len(slot_prompt) - 1], atol=1e-4, rtol=1e-4)
    for step in range(9):
        positions = [len(prompts[0]) + step, len(prompts[1]) + step, 0, len(prompts[2]) + step]
        ids = [tails[0][step], tails[1][step], 0, tails[2][step]]
        logits = model.decode(ids, positions)
        for row, slot in ((0, 0), (1, 1), (2, 3)):
            torch.testing.assert_close(logits[slot], full[row][positions[slot]], atol=1e-4, rtol=1e-4)
    assert list(model._graphs) == [(4, 0)]  # one graph for every length


def test_continuous_greedy_equals_the_per_batch_decoder_on_cuda(loaded_tiny_cuda_fp32):
    loaded = loaded_tiny_cuda_fp32
    prompts = chat_prompt_ids(loaded, PROMPTS)
    requests = [GenerationRequest(p, n) for p, n in zip(prompts, MAX_NEW)]
    scheduler = ContinuousScheduler(SlotModel(loaded, slots=2, slot_tokens=256), prefill_tokens=4096).start()
    try:
        got = [scheduler.submit(r).result(timeout=120).token_ids for r in requests]
    finally:
        scheduler.stop()
    assert got == [generate_batch(loaded, [r])[0].token_ids for r in requests]


def test_the_runtime_decodes_continuously_beside_hidden_state_extraction(tiny_model_dir, loaded_cuda, tmp_path):
    """The server's own set-up on CUDA (dtype auto, bf16): the continuous decoder is chosen and its graphs are
    captured at start; chat requests and hidden-state jobs then run at once on their two threads."""
    from services.inference.metrics import InferenceMetrics
    from services.inference.runtime import start_runtime
    from shared.hidden_file import verify_hidden_file
    from shared.settings import InferenceSettings
    from tests.services.inference.test_hidden import make_job

    settings = InferenceSettings(model_dir=tiny_model_dir, device="cuda", decode_slots=8, slot_tokens=512,
                                 hidden_batch_tokens=256, writer_threads=2)
    runtime = start_runtime(settings, loaded_cuda, InferenceMetrics())
    try:
        assert isinstance(runtime.scheduler, ContinuousScheduler)
        short, long = (pool.model for pool in runtime.scheduler._pools)
        assert sorted(short._graphs) == [(1, 0), (2, 0), (4, 0), (8, 0)]
        # The long pool: 4 slots (the default) of the tiny target's whole context, graphed at start too.
        assert (long.slots, long.slot_tokens) == (4, loaded_cuda.context_length)
        assert sorted(long._graphs) == [(1, 0), (2, 0), (4, 0)]
        prompts = chat_prompt_ids(loaded_cuda, PROMPTS * 3)
        requests = [GenerationRequest(p, 8 + 3 * i) for i, p in enumerate(prompts)]
        jobs = [make_job(loaded_cuda, tmp_path, f"{i:08d}", 20 + 7 * i, seed=i) for i in range(12)]
        chats = [runtime.scheduler.submit(r) for r in requests]
        states = [runtime.pipeline.submit(job) for job in jobs]
        replies = [f.result(timeout=120).token_ids for f in chats]
        written = [f.result(timeout=120) for f in states]
    finally:
        runtime.stop()
    assert replies == [generate_batch(loaded_cuda, [r])[0].token_ids for r in requests]
    for job, result in zip(jobs, written):
        verify_hidden_file(job.path, layer_ids=list(job.layer_ids), dtype="BF16", hidden_size=64, sha256=result.sha256)
