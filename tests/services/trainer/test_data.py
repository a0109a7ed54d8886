"""Training data: verified files only, every bad file named, truncation and padding."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from services.trainer.data import HiddenStateDataset, collate, list_hidden_files, verify_files
from shared import eagle3
from shared.errors import HiddenStateFileError
from shared.hidden_file import verify_hidden_file
from tests.services.trainer.conftest import LAYER_IDS, file_metadata


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
