"""Hidden-state extraction in-process: the forward pass, the file format, the pipeline's grouping."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from services.inference.hidden import HiddenJob, forward_hidden
from services.inference.pipeline import HiddenStatePipeline
from shared import SCHEMA_VERSION, eagle3
from shared.atomic import temp_files
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
    # Padded cost is longest × rows: 10,20,30,40 → 160 > 120, so [10,20,30] (90), [40,50] (100), [60].
    assert sizes == [3, 2, 1]
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
