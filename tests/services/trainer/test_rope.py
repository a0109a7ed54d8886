"""The drafter's RoPE is the engines': the target's (or base's) rope_scaling at train time, frequencies and
YaRN's attention factor equal to transformers' for a LlamaConfig of the same fields, and the export carries
rope_scaling and max_position_embeddings so the engine builds that same rotation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from modeling.export import export_drafter, load_drafter
from modeling.eagle3 import DrafterConfig, RotaryEmbedding, rope_scaling_of
from services.trainer.train import train_drafter
from shared.errors import UnsupportedRopeScaling
from shared.runspec import RunSpec

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    YARN,
]


def drafter_config(rope_scaling, max_positions=131072) -> DrafterConfig:
    return DrafterConfig(hidden_size=64, target_hidden_size=64, intermediate_size=192, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=100, draft_vocab_size=50, layer_ids=(1, 3, 4),
                         rope_theta=500000.0, max_position_embeddings=max_positions, rope_scaling=rope_scaling)


def transformers_rotary(hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' inv_freq and (cos, sin) at positions spanning the context, (1, T, hd) each."""
    rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.tensor([[0, 1, 7, 4095, 32767, 100000]])
    cos, sin = rotary(torch.zeros(1, 1, dtype=torch.float32), positions)
    return rotary.inv_freq, cos, sin


def ours(config: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(config)
    cos, sin = rotary(torch.tensor([[0, 1, 7, 4095, 32767, 100000]]))
    return rotary.inv_freq, cos[:, 0], sin[:, 0]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: (s or {}).get("rope_type", "default"))
def test_the_drafters_rotary_frequencies_are_transformers_for_the_same_config(scaling):
    config = drafter_config(scaling)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                     max_position_embeddings=131072, rope_scaling=dict(scaling) if scaling else None)
    for mine, theirs in zip(ours(config), transformers_rotary(hf)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert RotaryEmbedding(config).attention_scaling == LlamaRotaryEmbedding(hf).attention_scaling
    if scaling and scaling["rope_type"] == "yarn":
        assert RotaryEmbedding(config).attention_scaling > 1.0  # YaRN's mscale reaches cos and sin


@pytest.mark.parametrize("scaling", SCALINGS[1:], ids=lambda s: s["rope_type"])
def test_an_engine_reading_the_export_builds_the_rotation_the_drafter_trained_with(scaling, tmp_path):
    from modeling.eagle3 import Eagle3Drafter
    from services.trainer.vocab import build_mapping

    drafter = Eagle3Drafter(drafter_config(scaling))
    drafter.set_vocab_mapping(*build_mapping(torch.arange(100) % 7, 50))
    export = export_drafter(drafter, tmp_path / "export", target_model="t", target_fingerprint="f")
    written = json.loads((export / "config.json").read_text())
    assert written["rope_scaling"] == scaling and written["max_position_embeddings"] == 131072
    for mine, theirs in zip(ours(drafter.config), transformers_rotary(AutoConfig.from_pretrained(export))):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("config", "expected"), [
    ({"rope_theta": 1e4}, None),
    ({"rope_scaling": None, "rope_theta": 1e4}, None),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, None),  # transformers 5, plain
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, YARN),  # legacy "type"
    ({"rope_parameters": {"rope_theta": 1e6, **YARN}}, YARN),  # transformers 5: rope_theta is a field of its own
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, None),  # text positions: plain RoPE
])
def test_rope_scaling_is_read_from_either_config_style(config, expected):
    assert rope_scaling_of(config) == expected


def test_a_rope_type_the_drafter_cannot_reproduce_is_named():
    with pytest.raises(UnsupportedRopeScaling, match="'longrope'"):
        rope_scaling_of({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}})


@pytest.fixture()
def yarn_target(tiny_model_dir, tmp_path):
    """The tiny target with a long-context config: YaRN scaling, 131072 positions (transformers 5 style)."""
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "yarn-target")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(max_position_embeddings=131072, rope_parameters={"rope_theta": 10000.0, **YARN})
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_a_drafter_trained_for_a_yarn_target_trains_and_exports_with_its_rope_and_length(make_run, yarn_target, tmp_path):
    paths = make_run("long", train={"epochs": 1, "batch_size": 16, "save_every": 1000})
    result = train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=yarn_target, device="cpu")
    assert result.drafter.config.rope_scaling == YARN and result.drafter.config.max_position_embeddings == 131072
    assert RotaryEmbedding(result.drafter.config).attention_scaling == result.drafter.midlayer.self_attn.rope.attention_scaling > 1
    export = export_drafter(result.drafter, tmp_path / "export", target_model="tiny", target_fingerprint="f")
    written = json.loads((export / "config.json").read_text())
    assert written["rope_scaling"] == YARN and written["max_position_embeddings"] == 131072
    assert written["rope_theta"] == 10000.0
    assert load_drafter(export, yarn_target).config == result.drafter.config  # and it reads back the same
