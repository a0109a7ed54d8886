"""The DFlash export (modeling/dflash_export.py): the names, shapes and config fields vLLM's qwen3_dflash
loads, checked before publishing, and read back to the same drafter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling.dflash_export import export_dflash, is_dflash_export, load_dflash, verify_dflash_export
from shared.errors import CheckpointFormatError

pytestmark = pytest.mark.dflash


@pytest.fixture()
def exported(trained_dflash, tiny_target, tmp_path):
    return export_dflash(trained_dflash, tmp_path / "export", target_model="tiny", target_fingerprint=tiny_target.fingerprint,
                         dtype=torch.float32)


def rewrite(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_the_config_names_what_vllm_reads_and_nothing_that_would_mislead_it(exported, trained_dflash):
    config = json.loads((exported / "config.json").read_text())
    c = trained_dflash.config
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.layer_ids),
                                       "causal": False}
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4 and "rope_theta" in config
    assert "eagle_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config
    assert config["draftline"]["method"] == "dflash" and is_dflash_export(exported)
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]  # no mask_embedding.pt


def test_the_export_reads_back_to_the_same_drafter(exported, trained_dflash, tiny_target):
    loaded = load_dflash(exported, tiny_target.model_dir)
    assert loaded.config == trained_dflash.config
    a, b = loaded.checkpoint_state(), trained_dflash.checkpoint_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "missing"),
    (lambda t: t.update({"layers.0.self_attn.qkv_proj.weight": torch.zeros(2, 2)}), "unexpected"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :-64].contiguous()}), "fc.weight"),
    (lambda t: t.update({"norm.weight": t["norm.weight"].half()}), "norm.weight"),
])
def test_a_tensor_vllm_would_miss_or_misread_fails_verification_by_name(exported, change, message):
    rewrite(exported, change)
    with pytest.raises(CheckpointFormatError, match=message):
        verify_dflash_export(exported)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}), "other target layers"),
    (lambda c: c["dflash_config"].update({"target_layer_ids": [3, 1, 4]}), "ascending"),
    (lambda c: c.update({"architectures": ["Qwen3ForCausalLM"]}), "DFlashDraftModel"),
    (lambda c: c["dflash_config"].update({"mask_token_id": 10**6}), "mask_token_id"),
])
def test_a_config_vllm_would_read_otherwise_fails_verification(exported, change, message):
    config = json.loads((exported / "config.json").read_text())
    change(config)
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match=message):
        verify_dflash_export(exported)


def test_layers_with_their_own_k_norm_are_not_read_as_this_drafter(exported, tiny_target):
    rewrite(exported, lambda t: t.update({"layers.1.self_attn.k_norm.weight": t["layers.1.self_attn.k_norm.weight"] + 1}))
    with pytest.raises(CheckpointFormatError, match="k_norm"):
        load_dflash(exported, tiny_target.model_dir)
