"""The drafter's structure and the training-time-test alignment against the serving-time draft chain."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from modeling.eagle3 import DrafterConfig, Eagle3Drafter, KVCache
from services.trainer.objective import TTTObjective

SMALL = DrafterConfig(hidden_size=32, target_hidden_size=24, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=60, draft_vocab_size=40, layer_ids=(1, 3, 4))
NORMED = replace(SMALL, aux_norm=True)  # EAGLE-3.1's normalized auxiliary states (train.aux_norm)


def random_drafter(config: DrafterConfig = SMALL, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    drafter.load_embedding(torch.randn(config.vocab_size, config.hidden_size))
    with torch.no_grad():  # non-trivial norms so a swapped norm would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter.eval()


def test_parameter_names_are_the_export_keys_and_the_embedding_is_frozen():
    drafter = random_drafter()
    expected = {
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    }
    assert set(drafter.export_state()) == expected
    assert set(drafter.state_dict()) == expected | {"embed_tokens.weight"}
    assert not drafter.embed_tokens.weight.requires_grad
    assert "embed_tokens.weight" not in {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert drafter.fc.weight.shape == (32, 3 * 24)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 2 * 32)  # q/k/v read embedding ++ hidden
    normed = random_drafter(NORMED).export_state()
    norms = {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}  # vLLM's and SGLang's names for them
    assert set(normed) == expected | norms and all(normed[n].shape == (24,) for n in norms)  # the target's width


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def test_normalized_features_give_each_auxiliary_state_its_own_norm_before_fc():
    drafter = random_drafter(NORMED)
    aux = torch.randn(2, 5, 3 * 24) * torch.tensor([1.0] * 24 + [30.0] * 24 + [400.0] * 24)  # low, middle, high
    low, middle, high = aux.split(24, dim=-1)
    by_hand = torch.cat([rms_normed(x, norm.weight, NORMED.rms_norm_eps)
                         for x, norm in zip((low, middle, high), drafter.fc_norm)], dim=-1) @ drafter.fc.weight.T
    torch.testing.assert_close(drafter.fuse(aux), by_hand)
    # What the norm is for: a layer's scale no longer decides its share of the fused state.
    rescaled = torch.cat([low, middle / 30, high / 400], dim=-1)
    torch.testing.assert_close(drafter.fuse(rescaled), drafter.fuse(aux), rtol=1e-4, atol=1e-5)
    plain = random_drafter(SMALL)
    assert not torch.allclose(plain.fuse(rescaled), plain.fuse(aux), rtol=1e-2)


def test_from_target_config_takes_the_targets_width_and_caps_the_draft_vocabulary(tiny_model_dir):
    target = json.loads((tiny_model_dir / "config.json").read_text())
    config = DrafterConfig.from_target_config(target, draft_vocab_size=32000, layer_ids=[1, 3, 4])
    assert (config.hidden_size, config.target_hidden_size, config.intermediate_size) == (64, 64, 192)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == target["vocab_size"] and config.draft_vocab_size == target["vocab_size"]
    assert config.rope_theta == 10000.0 and config.layer_ids == (1, 3, 4)
    assert DrafterConfig.from_target_config(target, draft_vocab_size=100, layer_ids=[1, 3, 4]).draft_vocab_size == 100


def test_an_mla_target_gives_its_heads_and_v_head_dim_not_the_rope_width_transformers_writes_as_head_dim():
    kimi_k2 = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
               "num_key_value_heads": 64, "vocab_size": 163840, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0}
    saved_by_transformers_5 = {**kimi_k2, "model_type": "deepseek_v3", "head_dim": 64}
    for target in (kimi_k2, saved_by_transformers_5):
        config = DrafterConfig.from_target_config(target, draft_vocab_size=32000, layer_ids=[1, 29, 57])
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 64, 128)
        assert (config.hidden_size, config.intermediate_size) == (7168, 18432)
    tiny = {**saved_by_transformers_5, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
            "qk_nope_head_dim": 32, "v_head_dim": 48}
    config = DrafterConfig.from_target_config(tiny, draft_vocab_size=64, layer_ids=[0, 1, 2])
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 4, 48)
    assert DrafterConfig.from_target_config(tiny, draft_vocab_size=64, layer_ids=[0, 1, 2],
                                            num_key_value_heads=2).num_key_value_heads == 2


@torch.no_grad()
@pytest.mark.parametrize("config", [SMALL, NORMED], ids=["eagle3", "aux_norm"])
def test_training_time_test_step_k_equals_the_serving_chain_anchored_at_the_same_index(config):
    """Step k of the unroll at index t must be what the drafter computes at serving time after the target
    verified x_0..x_{t+1}: a cache over positions 0..t from the target's states, then k chained steps
    fed the (here teacher-forced) tokens x_{t+2}..x_{t+1+k} at positions t+1..t+k."""
    drafter, steps, length = random_drafter(config), 4, 14
    ids = torch.randint(0, SMALL.vocab_size, (1, length))
    aux = torch.randn(1, length, 3 * SMALL.target_hidden_size)
    unrolled = TTTObjective(drafter, steps).unroll(ids, aux)  # steps x (1, L, H)
    for t in (0, 5, length - steps - 1):
        cache = KVCache()
        hidden = drafter(drafter.fuse(aux[:, : t + 1]), ids[:, 1 : t + 2], torch.arange(t + 1)[None], cache)[:, -1:]
        torch.testing.assert_close(hidden, unrolled[0][:, t : t + 1], rtol=1e-5, atol=1e-5)
        for k in range(1, steps):
            hidden = drafter(hidden, ids[:, t + 1 + k : t + 2 + k], torch.tensor([[t + k]]), cache)
            torch.testing.assert_close(hidden, unrolled[k][:, t : t + 1], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_later_position_never_changes_an_earlier_output():
    drafter = random_drafter()
    ids = torch.randint(0, SMALL.vocab_size, (1, 10))
    aux = torch.randn(1, 10, 3 * SMALL.target_hidden_size)
    full = TTTObjective(drafter, 3).unroll(ids, aux)
    changed_ids, changed_aux = ids.clone(), aux.clone()
    changed_ids[0, 9], changed_aux[0, 9] = (ids[0, 9] + 1) % SMALL.vocab_size, 0.0
    partial = TTTObjective(drafter, 3).unroll(changed_ids, changed_aux)
    # Step k at index t reads tokens up to x_{t+1+k}; index 9 - 1 - k and earlier never see position 9.
    for k in range(3):
        torch.testing.assert_close(full[k][:, : 8 - k], partial[k][:, : 8 - k])


def test_config_rejects_heads_that_do_not_group():
    with pytest.raises(ValueError, match="kv groups"):
        DrafterConfig(hidden_size=32, target_hidden_size=32, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=3, head_dim=8, vocab_size=10, draft_vocab_size=10)
