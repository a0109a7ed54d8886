"""Hidden-state extraction in-process: the forward pass, the file format, the pipeline's grouping."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from services.inference.hidden import HiddenJob, forward_hidden, write_sample
from services.inference.pipeline import HiddenStatePipeline
from shared import SCHEMA_VERSION, eagle3
from shared.atomic import temp_files
from shared.errors import HiddenStateFileError
from shared.hidden_file import verify_hidden_file


def make_job(loaded, root: Path, name: str, length: int, *, layer_ids=(1, 3, 4), seed: int = 0) -> HiddenJob:
    ids = torch.randint(0, loaded.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [int(i >= length // 2) for i in range(length)]
    return HiddenJob(ids, mask, root / f"{name}.safetensors", f"{name}.safetensors", tuple(layer_ids),
                     {"sample_id": name})


def reference(loaded, job: HiddenJob) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(aux, last, logits)`` of one unpadded sample straight from the Hugging Face model."""
    with torch.inference_mode():
        out = loaded.model(torch.tensor([job.input_ids], device=loaded.device), output_hidden_states=True)
    states = out.hidden_states
    aux = torch.cat([states[eagle3.hf_hidden_index(i)] for i in job.layer_ids], dim=-1)[0]
    return aux, states[-1][0], out.logits[0]


def test_last_hidden_state_is_what_lm_head_turns_into_the_logits(loaded_tiny, tmp_path):
    job = make_job(loaded_tiny, tmp_path, "one", 23)
    with torch.inference_mode():
        aux, last = forward_hidden(loaded_tiny, [job])
        ref_aux, _, logits = reference(loaded_tiny, job)
        assert torch.allclose(loaded_tiny.model.lm_head(last[0]), logits, atol=1e-5, rtol=1e-5)
    assert aux.shape == (1, 23, 3 * 64) and last.shape == (1, 23, 64)
    assert torch.allclose(aux[0], ref_aux, atol=1e-5, rtol=1e-5)
    # Low, mid, high in that order: the low slice is decoder layer 1's output, nothing else.
    assert torch.allclose(aux[0, :, :64], ref_aux[:, :64]) and not torch.allclose(aux[0, :, :64], aux[0, :, 64:128])


def test_padded_group_gives_each_sample_its_own_states(loaded_tiny, tmp_path):
    jobs = [make_job(loaded_tiny, tmp_path, f"s{i}", n, seed=i) for i, n in enumerate([5, 31, 12])]
    jobs.append(make_job(loaded_tiny, tmp_path, "other-layers", 9, layer_ids=(0, 2, 6), seed=9))
    with torch.inference_mode():
        aux, last = forward_hidden(loaded_tiny, jobs)
    assert aux.shape == (4, 31, 192)
    for row, job in enumerate(jobs):
        ref_aux, ref_last, _ = reference(loaded_tiny, job)
        assert torch.allclose(aux[row, : job.num_tokens], ref_aux, atol=1e-4, rtol=1e-4)
        assert torch.allclose(last[row, : job.num_tokens], ref_last, atol=1e-4, rtol=1e-4)


def run_pipeline(loaded, jobs: list[HiddenJob], **kwargs) -> tuple[list, list[int]]:
    """Queue every job before the forward thread starts, so the grouping is deterministic."""
    sizes: list[int] = []
    written: list[int] = []
    pipeline = HiddenStatePipeline(loaded, on_batch=sizes.append, on_written=written.append, **kwargs)
    futures = [pipeline.submit(job) for job in jobs]
    pipeline.start()
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result(60))
        except Exception as exc:  # noqa: BLE001 - the test inspects which requests failed
            outcomes.append(exc)
    pipeline.stop()
    assert sum(written) == sum(o.bytes for o in outcomes if not isinstance(o, Exception))
    return outcomes, sizes


def test_pipeline_groups_by_padded_token_budget_and_writes_verified_files(loaded_tiny, tmp_path):
    lengths = [10, 20, 30, 40, 50, 60]
    jobs = [make_job(loaded_tiny, tmp_path / "shard", f"{i:08d}", n, seed=i) for i, n in enumerate(lengths)]
    results, sizes = run_pipeline(loaded_tiny, jobs, batch_tokens=120, writer_threads=2)
    # Longest first, padded cost longest × rows: [60,50] (120), [40,30,20] (120), [10].
    assert sizes == [2, 3, 1]
    for job, result in zip(jobs, results):
        info = verify_hidden_file(job.path, layer_ids=[1, 3, 4], dtype="F32", hidden_size=64, sha256=result.sha256)
        assert (info.num_tokens, result.num_tokens, result.path) == (job.num_tokens, job.num_tokens, job.relative_path)
        assert result.bytes == job.path.stat().st_size
        assert result.sha256 == hashlib.sha256(job.path.read_bytes()).hexdigest()
        assert result.shapes == {"input_ids": [job.num_tokens], "loss_mask": [job.num_tokens],
                                 "aux_hidden_states": [job.num_tokens, 192], "hidden_states": [job.num_tokens, 64]}
        tensors = load_file(job.path)
        assert tensors["input_ids"].dtype == torch.int64 and tensors["input_ids"].tolist() == job.input_ids
        assert tensors["loss_mask"].dtype == torch.uint8 and tensors["loss_mask"].tolist() == job.loss_mask
        ref_aux, ref_last, _ = reference(loaded_tiny, job)
        assert torch.allclose(tensors["aux_hidden_states"], ref_aux, atol=1e-4, rtol=1e-4)
        assert torch.allclose(tensors["hidden_states"], ref_last, atol=1e-4, rtol=1e-4)
    assert temp_files(tmp_path) == []


def test_queued_requests_are_grouped_by_length_not_by_arrival(loaded_tiny, tmp_path, monkeypatch):
    """Requests queued together (as many extractors send them) are sorted longest first before grouping,
    so a group pads little: arriving 10, 60, 12, 58, 11, 59 with a budget of 120 padded tokens, grouped in
    arrival order they would compute 354 positions for 210 real ones; sorted, 258."""
    import services.inference.pipeline as pipeline_module

    seen: list[list[int]] = []
    real_forward = pipeline_module.forward_hidden

    def recording_forward(loaded, jobs):
        seen.append([job.num_tokens for job in jobs])
        return real_forward(loaded, jobs)

    monkeypatch.setattr(pipeline_module, "forward_hidden", recording_forward)
    lengths = [10, 60, 12, 58, 11, 59]
    jobs = [make_job(loaded_tiny, tmp_path, f"{i:08d}", n, seed=i) for i, n in enumerate(lengths)]
    results, _ = run_pipeline(loaded_tiny, jobs, batch_tokens=120, writer_threads=2)
    assert seen == [[60, 59], [58, 12], [11, 10]]
    assert sum(max(group) * len(group) for group in seen) == 258
    assert [r.num_tokens for r in results] == lengths  # each request gets its own file back
    for job, result in zip(jobs, results):
        verify_hidden_file(job.path, layer_ids=[1, 3, 4], dtype="F32", hidden_size=64, sha256=result.sha256)


def test_file_metadata_names_format_layers_model_and_request_keys(loaded_tiny, tmp_path):
    job = make_job(loaded_tiny, tmp_path, "meta", 7)
    run_pipeline(loaded_tiny, [job], batch_tokens=64, writer_threads=1)
    with safe_open(job.path, "pt") as handle:
        meta = handle.metadata()
    assert meta == {
        "sample_id": "meta",
        eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE,
        eagle3.META_SCHEMA: str(SCHEMA_VERSION),
        eagle3.META_LAYER_IDS: json.dumps([1, 3, 4]),
        eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION,
        eagle3.META_MODEL: loaded_tiny.name,
        eagle3.META_MODEL_FINGERPRINT: loaded_tiny.fingerprint,
        eagle3.META_DTYPE: "F32",
    }


def test_sample_longer_than_the_budget_runs_alone(loaded_tiny, tmp_path):
    jobs = [make_job(loaded_tiny, tmp_path, "long", 50), make_job(loaded_tiny, tmp_path, "short", 5)]
    results, sizes = run_pipeline(loaded_tiny, jobs, batch_tokens=16, writer_threads=1)
    assert sizes == [1, 1]
    assert [r.num_tokens for r in results] == [50, 5]


def test_a_failed_write_fails_only_its_request_and_leaves_no_temp_file(loaded_tiny, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    bad = HiddenJob([1, 2, 3], [0, 1, 1], blocker / "x.safetensors", "not-a-dir/x.safetensors", (1, 3, 4))
    good = make_job(loaded_tiny, tmp_path, "good", 6)
    (bad_result, good_result), sizes = run_pipeline(loaded_tiny, [bad, good], batch_tokens=64, writer_threads=2)
    assert sizes == [2]
    assert isinstance(bad_result, OSError)
    verify_hidden_file(good.path, sha256=good_result.sha256)
    assert temp_files(tmp_path) == []


def test_host_buffers_are_reused_smallest_fit_first_and_bounded():
    from services.inference.pipeline import PinnedBuffers

    buffers = PinnedBuffers(keep=2, pin=False)
    big, view = buffers.take((10, 300), torch.bfloat16)  # 6000 bytes → an 8192-byte buffer
    assert view.shape == (10, 300) and view.dtype == torch.bfloat16 and big.numel() == 8192
    small, _ = buffers.take((100,), torch.float32)  # 400 bytes → 512
    buffers.give(big)
    buffers.give(small)
    again, view = buffers.take((50,), torch.float32)  # both fit; the smaller one is taken
    assert again is small and view.data_ptr() == small.data_ptr()
    assert buffers.take((3000,), torch.float32)[0] is not big  # 12000 bytes: nothing fits, a new one
    buffers.give(again)
    buffers.give(torch.empty(16, dtype=torch.uint8))  # beyond ``keep``: dropped
    assert buffers.take((4000,), torch.uint8)[0] is big


def fp8_job(job: HiddenJob, name: str) -> HiddenJob:
    return dataclasses.replace(job, path=job.path.with_name(f"{name}.safetensors"), relative_path=f"{name}.safetensors",
                               storage="fp8")


def test_an_fp8_group_writes_e4m3_states_with_a_scale_per_token_and_layer_beside_exact_ones(loaded_tiny, tmp_path):
    exact = make_job(loaded_tiny, tmp_path, "exact", 40)
    fp8 = fp8_job(exact, "fp8")
    (exact_result, fp8_result), sizes = run_pipeline(loaded_tiny, [exact, fp8], batch_tokens=128, writer_threads=2)
    assert sizes == [2]  # one forward pass serves both storages
    assert (exact_result.dtype, fp8_result.dtype) == ("F32", "F8_E4M3")
    info = verify_hidden_file(fp8.path, dtype="F8_E4M3", hidden_size=64, sha256=fp8_result.sha256)
    assert info.num_tokens == 40 and fp8_result.bytes == fp8.path.stat().st_size
    assert fp8_result.shapes == exact_result.shapes
    with safe_open(fp8.path, "pt") as handle:
        meta = handle.metadata()
        stored = {name: handle.get_tensor(name) for name in handle.keys()}
    assert meta[eagle3.META_DTYPE] == "F32"  # the dtype the target computed the states in
    assert stored["aux_hidden_states_scale"].shape == (40, 3) and stored["hidden_states_scale"].shape == (40, 1)
    assert stored["aux_hidden_states_scale"].dtype == torch.bfloat16
    ref_aux, ref_last, _ = reference(loaded_tiny, exact)
    for name, ref, layers in (("aux_hidden_states", ref_aux, 3), ("hidden_states", ref_last, 1)):
        q, scale = stored[name], stored[f"{name}_scale"]
        assert q.dtype == torch.float8_e4m3fn
        grouped_q = q.float().unflatten(-1, (layers, 64))  # (L, layers, H)
        # Each token's largest value in each layer lands on e4m3's largest finite value, 448.
        assert (grouped_q.abs().amax(dim=-1) == 448).all()
        grouped_ref = ref.unflatten(-1, (layers, 64))
        back = grouped_q * scale.float().unsqueeze(-1)
        assert ((back - grouped_ref).abs() <= grouped_ref.abs() / 16 + grouped_ref.abs().amax(-1, keepdim=True) / 448 / 1000).all()
    # Half a byte per value saved twice over against fp32's four: the states take a quarter, scales 8 bytes a token.
    assert fp8_result.bytes < exact_result.bytes / 3


def test_fp8_rows_of_a_padded_group_hold_exactly_their_own_states_quantized(loaded_tiny, tmp_path):
    """The pipeline quantizes the padded batch at once (on the device where there is one): each fp8 file holds
    what quantizing its own row alone gives, and the padding of a longer row changes nothing."""
    from modeling.fp8 import quantize_fp8

    jobs = []
    for name, length, seed in (("long", 40, 1), ("short", 23, 2)):
        exact = make_job(loaded_tiny, tmp_path, name, length, seed=seed)
        jobs += [exact, fp8_job(exact, f"{name}-fp8")]
    _, sizes = run_pipeline(loaded_tiny, jobs, batch_tokens=160, writer_threads=2)
    assert sizes == [4]  # one padded group of both lengths and both storages
    for exact, fp8 in (jobs[:2], jobs[2:]):
        states, quantized = load_file(exact.path), load_file(fp8.path)
        for name, layers in (("aux_hidden_states", 3), ("hidden_states", 1)):
            q, scale = quantize_fp8(states[name], layers)
            assert q.shape == quantized[name].shape == (exact.num_tokens, 64 * layers)
            assert torch.equal(q.view(torch.uint8), quantized[name].view(torch.uint8))
            assert torch.equal(scale, quantized[f"{name}_scale"])


def test_fp8_keeps_a_row_of_zeros_zero_and_names_non_finite_states(loaded_tiny, tmp_path):
    from modeling.fp8 import quantize_fp8

    states = torch.randn(4, 3 * 8)
    states[1] = 0.0
    q, scale = quantize_fp8(states, 3)
    assert (q[1].float() == 0).all() and (scale[1] > 0).all()
    job = fp8_job(make_job(loaded_tiny, tmp_path, "x", 4), "nan")
    aux = torch.randn(4, 192)
    aux[2, 5] = float("nan")
    write_sample(loaded_tiny, job, aux, torch.randn(4, 64))
    with pytest.raises(HiddenStateFileError, match="not finite and positive|non-finite"):
        verify_hidden_file(job.path)
