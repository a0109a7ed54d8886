"""The inference server's CUDA paths for real: bf16 loading, the hidden-state pipeline's pinned buffers and
non_blocking copies behind an event, and the bf16 decode loop against Hugging Face ``generate``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from services.inference.decode import GenerationRequest, generate_batch
from services.inference.hidden import HiddenJob
from services.inference.pipeline import HiddenStatePipeline
from services.inference.sampling import SamplingParams
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from tests.services.inference.test_decode import MAX_NEW, PROMPTS
from tests.services.inference.test_hidden import make_job, reference

pytestmark = pytest.mark.gpu

LENGTHS = [17, 64, 33, 5, 128, 90]
# Two references. The same model in bf16 on the GPU, one unpadded sample at a time: what the pipeline
# (groups, padding, pinned buffers, non_blocking copies) must reproduce up to bf16 kernels taking other
# shapes; a relative step of bf16 is 2^-8 ≈ 0.4%, so 2% allows a few steps of drift and no wrong row.
# And the CPU in float32: bf16 compute itself drifts with depth, and the final norm rescales each row to
# unit RMS, keeping the relative error rather than shrinking it (5.8% measured on the H200 for the last
# state, under 4% for the auxiliary ones), so that bound is 8%. Another sample's states are off by far more.
SAME_DTYPE_TOLERANCE = 0.02
REL_TOLERANCE = 0.08


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_auto_settings_load_the_target_in_bf16_on_the_gpu(loaded_cuda):
    assert loaded_cuda.device.type == "cuda" and loaded_cuda.dtype == torch.bfloat16
    assert loaded_cuda.dtype_name == "BF16"
    params = list(loaded_cuda.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)


def test_pipeline_on_cuda_writes_through_pinned_buffers_what_a_cpu_fp32_forward_computes(loaded_cuda, loaded_cpu, tmp_path):
    jobs = [make_job(loaded_cuda, tmp_path / "shard", f"{i:08d}", n, seed=i) for i, n in enumerate(LENGTHS)]
    results, sizes, pipeline = run_pipeline_kept(loaded_cuda, jobs, batch_tokens=512, writer_threads=2)
    assert sum(sizes) == len(jobs) and max(sizes) > 1  # rows of different lengths shared a padded group
    # The host side went through page-locked buffers, handed back for reuse once the writers were done.
    buffers = pipeline._pinned._free
    assert buffers and all(b.is_pinned() and b.device.type == "cpu" for b in buffers)
    for job, result in zip(jobs, results):
        verify_hidden_file(job.path, layer_ids=[1, 3, 4], dtype="BF16", hidden_size=64, sha256=result.sha256)
        tensors = load_file(job.path)
        assert tensors["input_ids"].tolist() == job.input_ids and tensors["loss_mask"].tolist() == job.loss_mask
        same_aux, same_last, _ = reference(loaded_cuda, job)  # bf16 on the GPU, one unpadded sample
        assert rel_error(tensors["aux_hidden_states"], same_aux.cpu()) < SAME_DTYPE_TOLERANCE
        assert rel_error(tensors["hidden_states"], same_last.cpu()) < SAME_DTYPE_TOLERANCE
        ref_aux, ref_last, _ = reference(loaded_cpu, job)  # fp32 on the CPU, one unpadded sample
        assert tensors["aux_hidden_states"].dtype == tensors["hidden_states"].dtype == torch.bfloat16
        assert rel_error(tensors["aux_hidden_states"], ref_aux) < REL_TOLERANCE
        assert rel_error(tensors["hidden_states"], ref_last) < REL_TOLERANCE
        for third in range(3):  # each layer's slice on its own: a shifted or swapped slice would not pass
            cols = slice(64 * third, 64 * (third + 1))
            assert rel_error(tensors["aux_hidden_states"][:, cols], ref_aux[:, cols]) < REL_TOLERANCE
    # The bound can fail: another sample's reference (same length, other tokens) is far off.
    other = make_job(loaded_cuda, tmp_path, "other", LENGTHS[0], seed=99)
    assert rel_error(load_file(jobs[0].path)["aux_hidden_states"], reference(loaded_cpu, other)[0]) > 4 * REL_TOLERANCE
    assert temp_files(tmp_path) == []


def test_fp8_files_quantized_on_cuda_equal_the_cpu_quantization_of_the_same_bf16_states(loaded_cuda, tmp_path):
    """The pipeline quantizes on the device before the pinned copy; the bytes must be those the CPU's
    ``quantize_fp8`` makes of the same bf16 states (here: a bf16 file of the same tokens in the same group)."""
    from modeling.fp8 import quantize_fp8
    from tests.services.inference.test_hidden import fp8_job

    jobs = []
    for i, n in enumerate(LENGTHS):
        exact = make_job(loaded_cuda, tmp_path / "shard", f"{i:08d}", n, seed=i)
        jobs += [exact, fp8_job(exact, f"{i:08d}-fp8")]
    results, sizes, _ = run_pipeline_kept(loaded_cuda, jobs, batch_tokens=1024, writer_threads=2)
    assert max(sizes) > 2  # padded groups mixing lengths and storages
    for exact, fp8, result in zip(jobs[::2], jobs[1::2], results[1::2]):
        verify_hidden_file(fp8.path, dtype="F8_E4M3", hidden_size=64, sha256=result.sha256)
        states, quantized = load_file(exact.path), load_file(fp8.path)
        for name, layers in (("aux_hidden_states", 3), ("hidden_states", 1)):
            q, scale = quantize_fp8(states[name], layers)
            assert torch.equal(q.view(torch.uint8), quantized[name].view(torch.uint8)), name
            assert torch.equal(scale, quantized[f"{name}_scale"]), name
    assert temp_files(tmp_path) == []


def run_pipeline_kept(loaded, jobs: list[HiddenJob], **kwargs) -> tuple[list, list[int], HiddenStatePipeline]:
    """Every job queued before the forward thread starts (a deterministic grouping); the pipeline is
    returned too, so its host buffers can be inspected."""
    sizes: list[int] = []
    pipeline = HiddenStatePipeline(loaded, on_batch=sizes.append, **kwargs)
    futures = [pipeline.submit(job) for job in jobs]
    pipeline.start()
    results = [future.result(120) for future in futures]
    pipeline.stop()
    return results, sizes, pipeline


@pytest.fixture(scope="module")
def chat_ids(loaded_cuda) -> list[list[int]]:
    tokenizer = loaded_cuda.tokenizer
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for p in PROMPTS]


def hf_greedy_cuda(loaded, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids], device=loaded.device), do_sample=False, max_new_tokens=max_new)
    return out[0, len(ids):].tolist()


def test_bf16_greedy_chat_decode_on_cuda_equals_hf_generate(loaded_cuda, chat_ids):
    replies = []
    for ids, max_new in zip(chat_ids, MAX_NEW):
        (result,) = generate_batch(loaded_cuda, [GenerationRequest(ids, max_new)])
        assert result.token_ids == hf_greedy_cuda(loaded_cuda, ids, max_new)
        stopped = result.token_ids[-1] in loaded_cuda.eos_token_ids
        assert result.finish_reason == ("stop" if stopped else "length")
        replies.append(result.token_ids)
    assert sum(len(r) for r in replies) > len(replies)  # real replies, not one token each


def test_bf16_batched_rows_on_cuda_equal_their_hf_generate(loaded_cuda, chat_ids):
    # Left padding in bf16: the rows share GEMMs and masked attention, and each must still decode alone.
    batched = generate_batch(loaded_cuda, [GenerationRequest(ids, n) for ids, n in zip(chat_ids, MAX_NEW)])
    for ids, max_new, result in zip(chat_ids, MAX_NEW, batched):
        assert result.token_ids == hf_greedy_cuda(loaded_cuda, ids, max_new)


def test_seeded_sampling_on_cuda_repeats_and_really_samples(loaded_cuda, chat_ids):
    requests = [GenerationRequest(ids, 12, SamplingParams(temperature=1.0, top_p=0.95, seed=i)) for i, ids in enumerate(chat_ids)]
    first = [r.token_ids for r in generate_batch(loaded_cuda, requests)]
    assert first == [r.token_ids for r in generate_batch(loaded_cuda, requests)]
    assert any(tokens != hf_greedy_cuda(loaded_cuda, ids, 12) for tokens, ids in zip(first, chat_ids))
