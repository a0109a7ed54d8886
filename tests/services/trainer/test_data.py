"""Training data: verified files only, every bad file named, truncation and padding."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from services.trainer.data import Batch, HiddenStateDataset, collate, list_hidden_files, verify_files
from shared import eagle3
from shared.errors import HiddenStateFileError
from shared.hidden_file import verify_hidden_file
from tests.support.tiny_runs import LAYER_IDS, file_metadata


def test_fixture_files_pass_the_shared_verification(make_run, tiny_samples):
    paths = make_run()
    files = list_hidden_files(paths)
    assert [sid for sid, _ in files] == list(range(len(tiny_samples)))
    for _, path in files:
        info = verify_hidden_file(path, layer_ids=LAYER_IDS, hidden_size=64)
        assert info.metadata[eagle3.META_CONVENTION] == eagle3.LAYER_CONVENTION


def test_listing_ignores_temp_files_and_foreign_names(make_run):
    paths = make_run()
    shard = paths.hidden(0).parent
    (shard / ".tmp-00000099.safetensors.abc123").write_bytes(b"partial")
    (shard / "notes.safetensors").write_bytes(b"x")
    assert len(list_hidden_files(paths)) == 16


def test_a_truncated_file_stops_training_naming_it(make_run):
    paths = make_run()
    victim = paths.hidden(5)
    victim.write_bytes(victim.read_bytes()[:-100])
    files = [p for _, p in list_hidden_files(paths)]
    with pytest.raises(HiddenStateFileError, match=str(victim)):
        verify_files(files, layer_ids=LAYER_IDS, hidden_size=64)


def test_files_from_other_layers_are_rejected(make_run):
    paths = make_run()
    files = [p for _, p in list_hidden_files(paths)]
    with pytest.raises(HiddenStateFileError, match="layer ids"):
        verify_files(files, layer_ids=[1, 3, 5], hidden_size=64)


def test_files_from_two_different_targets_are_rejected(make_run, tiny_target, tiny_samples):
    paths = make_run()
    meta = {**file_metadata(tiny_target), eagle3.META_MODEL_FINGERPRINT: "another-target"}
    save_file(tiny_samples[3], str(paths.hidden(3)), metadata=meta)
    with pytest.raises(HiddenStateFileError, match="00000003.safetensors: model_fingerprint"):
        verify_files([p for _, p in list_hidden_files(paths)], layer_ids=LAYER_IDS, hidden_size=64)


def test_no_files_is_an_error_not_an_empty_training(make_run):
    with pytest.raises(HiddenStateFileError, match="no hidden-state files"):
        verify_files([], layer_ids=LAYER_IDS, hidden_size=64)


def test_dataset_truncates_and_collate_right_pads(make_run, tiny_samples):
    paths = make_run()
    files = [p for _, p in list_hidden_files(paths)]
    lengths = [s[eagle3.INPUT_IDS].shape[0] for s in tiny_samples]
    shortest, longest = lengths.index(min(lengths)), lengths.index(max(lengths))
    limit = min(lengths) + 5
    assert max(lengths) > limit  # the longest sample really gets truncated
    dataset = HiddenStateDataset(files, max_length=limit)
    items = [dataset[i] for i in (shortest, longest)]
    assert items[1][eagle3.INPUT_IDS].shape == (limit,)
    assert torch.equal(items[1][eagle3.AUX_HIDDEN], tiny_samples[longest][eagle3.AUX_HIDDEN][:limit])
    batch = collate(items)
    short = lengths[shortest]
    assert batch.input_ids.shape == (2, limit) and batch.aux_hidden.shape == (2, limit, 192)
    assert batch.lengths.tolist() == [short, limit]
    assert not batch.loss_mask[0, short:].any() and (batch.input_ids[0, short:] == 0).all()
    assert torch.equal(batch.last_hidden[0, :short], tiny_samples[shortest][eagle3.LAST_HIDDEN])


def batches(paths, limit: int = 4096) -> Batch:
    """Every file of the run in one batch, on the CPU in float32, as a training step receives it."""
    dataset = HiddenStateDataset([p for _, p in list_hidden_files(paths)], max_length=limit)
    return collate([dataset[i] for i in range(len(dataset))]).to(torch.device("cpu"), torch.float32)


def test_training_data_from_fp8_files_equals_the_target_dtype_files_within_fp8_rounding(make_run, tiny_samples):
    exact, fp8 = batches(make_run("exact")), batches(make_run("fp8", storage="fp8"))
    assert torch.equal(exact.input_ids, fp8.input_ids) and torch.equal(exact.loss_mask, fp8.loss_mask)
    for name in ("aux_hidden", "last_hidden"):
        x, y = getattr(exact, name), getattr(fp8, name)
        assert y.dtype == torch.float32 and y.shape == x.shape
        # e4m3 keeps 3 mantissa bits: at most 2^-4 relative error for each value, plus the rounding of the
        # subnormals near zero (steps of 2^-9 scales, and a scale is at most 1/448 of the row's largest value).
        row_max = x.abs().amax(dim=-1, keepdim=True)
        assert ((y - x).abs() <= x.abs() * (1 / 16 + 1e-6) + row_max * (1.01 / 448 / 1024)).all()
        assert not torch.equal(x, y)  # the fp8 run really holds other values
        assert 0.005 < ((y - x).norm() / x.norm()).item() < 0.04
        assert all((y[row, n:] == 0).all() for row, n in enumerate(fp8.lengths.tolist()))  # padding stays zero


def test_fp8_batches_travel_as_fp8_with_their_scales_until_they_reach_the_device(make_run):
    paths = make_run("fp8", storage="fp8")
    dataset = HiddenStateDataset([p for _, p in list_hidden_files(paths)], max_length=4096)
    batch = collate([dataset[0], dataset[1]])
    assert batch.aux_hidden.dtype == batch.last_hidden.dtype == torch.float8_e4m3fn
    assert batch.aux_scale.shape == (*batch.aux_hidden.shape[:2], 3) and batch.last_scale.shape[-1] == 1
    assert batch.without_loss().aux_scale is batch.aux_scale
    moved = batch.to(torch.device("cpu"), torch.float32)
    assert moved.aux_scale is None and moved.aux_hidden.dtype == torch.float32
    expected = (batch.aux_hidden.float().unflatten(-1, (3, 64)) * batch.aux_scale.float().unsqueeze(-1)).flatten(-2)
    assert torch.equal(moved.aux_hidden, expected)


def test_a_run_mixing_fp8_and_target_dtype_files_is_rejected_naming_the_file(make_run, tiny_target, tiny_samples):
    paths = make_run("mixed", storage="fp8")
    save_file(tiny_samples[3], str(paths.hidden(3)), metadata=file_metadata(tiny_target))
    with pytest.raises(HiddenStateFileError, match="00000003.safetensors: states in F32.*stores F8_E4M3"):
        verify_files([p for _, p in list_hidden_files(paths)], layer_ids=LAYER_IDS, hidden_size=64)
