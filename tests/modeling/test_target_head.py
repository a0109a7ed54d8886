"""The target's embedding and lm_head, read from safetensors without building the model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling.target_head import load_target_head
from shared.errors import CheckpointFormatError


def test_single_file_target_gives_the_models_own_embedding_and_head(tiny_target):
    head = load_target_head(tiny_target.model_dir)
    torch.testing.assert_close(head.embed, tiny_target.model.get_input_embeddings().weight.detach())
    torch.testing.assert_close(head.lm_head, tiny_target.model.lm_head.weight.detach())
    hidden = torch.randn(3, head.embed.shape[1])
    torch.testing.assert_close(head.logits(hidden), tiny_target.model.lm_head(hidden).detach())


def sharded_copy(src, dst, *, tie: bool = False):
    """The tiny target re-saved as two shards with an index, the way large checkpoints ship."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = tie
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    if tie:
        tensors.pop("lm_head.weight")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(dst / file))
        weight_map.update({n: file for n in shard_names})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_sharded_target_is_read_through_its_index(tiny_target, tmp_path):
    tensors = sharded_copy(tiny_target.model_dir, tmp_path / "sharded")
    head = load_target_head(tmp_path / "sharded")
    assert torch.equal(head.embed, tensors["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head, tensors["lm_head.weight"])


def test_tied_target_uses_the_embedding_as_its_head(tiny_target, tmp_path):
    tensors = sharded_copy(tiny_target.model_dir, tmp_path / "tied", tie=True)
    head = load_target_head(tmp_path / "tied")
    assert torch.equal(head.lm_head, tensors["model.embed_tokens.weight"])


def test_untied_target_without_a_head_is_a_named_error(tiny_target, tmp_path):
    shutil.copytree(tiny_target.model_dir, tmp_path / "headless")
    tensors = load_file(tmp_path / "headless" / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, str(tmp_path / "headless" / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="no lm_head"):
        load_target_head(tmp_path / "headless")
