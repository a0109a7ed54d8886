"""The export vLLM and SGLang load: every key with its shape and dtype, layer ids in both conventions, the norm
switches the engines read (EAGLE-3.1's fc_norm written as trained, the ones the drafter does not compute refused)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modeling.export import export_drafter, load_drafter, verify_export
from modeling.eagle3 import DrafterConfig, Eagle3Drafter, ttt_unroll
from modeling.target_head import load_target_head
from services.trainer.vocab import build_mapping
from shared import eagle3
from shared.atomic import TEMP_PREFIX
from shared.errors import CheckpointFormatError

DRAFT_VOCAB = 256


def tiny_drafter(tiny_target, **overrides) -> Eagle3Drafter:
    target = json.loads((tiny_target.model_dir / "config.json").read_text())
    torch.manual_seed(0)
    config = DrafterConfig.from_target_config(target, draft_vocab_size=DRAFT_VOCAB, layer_ids=[1, 3, 4], **overrides)
    model = Eagle3Drafter(config)
    model.load_embedding(load_target_head(tiny_target.model_dir).embed)
    model.set_vocab_mapping(*build_mapping(torch.arange(target["vocab_size"]) % 7, DRAFT_VOCAB))
    with torch.no_grad():  # norm weights other than ones, so a norm left out or swapped shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture()
def drafter(tiny_target) -> Eagle3Drafter:
    return tiny_drafter(tiny_target)


@pytest.fixture()
def normed_drafter(tiny_target) -> Eagle3Drafter:
    """EAGLE-3.1's normalized auxiliary states (train.aux_norm)."""
    return tiny_drafter(tiny_target, aux_norm=True)


@pytest.fixture()
def exported(drafter, tmp_path, tiny_target):
    return export_drafter(drafter, tmp_path / "export", target_model="tiny", target_fingerprint=tiny_target.fingerprint)


def expected_table(vocab: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """EAGLE3.md's checkpoint for the tiny target: H=64, I=192, 4 heads / 2 kv heads of 16, Vd=256."""
    return {
        "midlayer.self_attn.q_proj.weight": ((4 * 16, 2 * 64), "BF16"),  # q/k/v read embedding ++ hidden (2H)
        "midlayer.self_attn.k_proj.weight": ((2 * 16, 2 * 64), "BF16"),
        "midlayer.self_attn.v_proj.weight": ((2 * 16, 2 * 64), "BF16"),
        "midlayer.self_attn.o_proj.weight": ((64, 4 * 16), "BF16"),
        "midlayer.mlp.gate_proj.weight": ((192, 64), "BF16"),
        "midlayer.mlp.up_proj.weight": ((192, 64), "BF16"),
        "midlayer.mlp.down_proj.weight": ((64, 192), "BF16"),
        "midlayer.input_layernorm.weight": ((64,), "BF16"),
        "midlayer.hidden_norm.weight": ((64,), "BF16"),
        "midlayer.post_attention_layernorm.weight": ((64,), "BF16"),
        "fc.weight": ((64, 3 * 64), "BF16"),
        "norm.weight": ((64,), "BF16"),
        "lm_head.weight": ((DRAFT_VOCAB, 64), "BF16"),
        "d2t": ((DRAFT_VOCAB,), "I64"),
        "t2d": ((vocab,), "BOOL"),
    }


def test_export_holds_every_key_vllm_and_sglang_need_with_its_shape_and_dtype(exported, tiny_target):
    vocab = tiny_target.model.config.vocab_size
    with safe_open(exported / "model.safetensors", framework="pt") as handle:
        found = {name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype()) for name in handle.keys()}
    assert found == expected_table(vocab)  # exactly these: the frozen embedding stays with the target
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["norm_before_residual"] is False  # our residual starts from the un-normed hidden state
    assert config["fc_norm"] is config["norm_before_fc"] is config["norm_output"] is False  # no norm the drafter lacks
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (64, 192, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (vocab, DRAFT_VOCAB, 64)
    assert config["torch_dtype"] == "bfloat16" and config["eagle_config"]["use_aux_hidden_state"] is True
    assert config["draftline"]["target_model"] == "tiny"
    assert config["draftline"]["target_fingerprint"] == tiny_target.fingerprint
    assert verify_export(exported) == config


def test_layer_ids_name_the_same_tensors_in_vllm_and_sglang(exported):
    """We extracted the outputs of decoder layers [1, 3, 4] (HF hidden_states[2], [4], [5]).
    SGLang captures the output of each eagle_config id; vLLM captures the input of each top-level id."""
    config = json.loads((exported / "config.json").read_text())
    ours = config["draftline"]["layer_ids"]
    assert config["draftline"]["layer_convention"] == eagle3.LAYER_CONVENTION
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ours == [1, 3, 4]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    hf_index = [eagle3.hf_hidden_index(i) for i in ours]
    assert hf_index == config["eagle_aux_hidden_state_layer_ids"]  # input of layer i == HF hidden_states[i]


def rewrite_weights(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_verify_export_rejects_a_missing_key(exported):
    rewrite_weights(exported, lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(CheckpointFormatError, match="midlayer.hidden_norm.weight missing"):
        verify_export(exported)


def test_verify_export_rejects_a_wrong_shape(exported):
    rewrite_weights(exported, lambda t: t.update({"fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointFormatError, match=r"fc.weight has shape \[64, 128\], expected \[64, 192\]"):
        verify_export(exported)


def test_verify_export_rejects_a_wrong_dtype(exported):
    rewrite_weights(exported, lambda t: t.update({"d2t": t["d2t"].to(torch.int32)}))
    with pytest.raises(CheckpointFormatError, match="d2t has dtype I32, expected I64"):
        verify_export(exported)


def test_verify_export_rejects_a_mapping_that_is_not_one(exported):
    rewrite_weights(exported, lambda t: t.update({"d2t": torch.zeros_like(t["d2t"])}))  # not what t2d marks
    with pytest.raises(CheckpointFormatError, match="t2d"):
        verify_export(exported)


def test_verify_export_rejects_layer_ids_one_engine_would_misread(exported):
    config = json.loads((exported / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # vLLM would read the layers below ours
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match="plus one"):
        verify_export(exported)


def test_verify_export_names_missing_files(tmp_path):
    with pytest.raises(CheckpointFormatError, match="config.json: missing"):
        verify_export(tmp_path)


def test_load_drafter_gives_back_the_exported_weights_and_mapping(exported, drafter, tiny_target):
    loaded = load_drafter(exported, tiny_target.model_dir)
    assert loaded.config == drafter.config
    for name, tensor in drafter.export_state().items():
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        assert torch.equal(loaded.state_dict()[name], expected), name
    assert torch.equal(loaded.embed_tokens.weight, drafter.embed_tokens.weight)


def test_transformers_parses_the_config_as_a_one_layer_llama(exported):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(exported)
    assert config.model_type == "llama" and config.num_hidden_layers == 1 and config.hidden_size == 64


def test_exporting_again_replaces_the_export_and_leaves_no_temp_directories(drafter, exported, tiny_target):
    with torch.no_grad():
        drafter.norm.weight.fill_(2.0)
    export_drafter(drafter, exported, target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    assert load_file(exported / "model.safetensors")["norm.weight"].float().eq(2.0).all()
    assert [p.name for p in exported.parent.iterdir() if p.name.startswith(TEMP_PREFIX)] == []


# ---- EAGLE-3.1's normalized auxiliary states (train.aux_norm) --------------------------------------------------

FC_NORMS = {f"fc_norm.{i}.weight": ((64,), "BF16") for i in range(3)}  # one per auxiliary state, the target's width


@pytest.fixture()
def normed_export(normed_drafter, tmp_path, tiny_target):
    return export_drafter(normed_drafter, tmp_path / "normed", target_model="tiny",
                          target_fingerprint=tiny_target.fingerprint, dtype=torch.float32)


def test_an_aux_norm_export_declares_fc_norm_and_holds_one_norm_per_auxiliary_state(normed_drafter, tmp_path, tiny_target):
    exported = export_drafter(normed_drafter, tmp_path / "bf16", target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    with safe_open(exported / "model.safetensors", framework="pt") as handle:
        found = {name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype()) for name in handle.keys()}
    assert found == expected_table(tiny_target.model.config.vocab_size) | FC_NORMS
    config = verify_export(exported)
    # The keys vLLM 0.32 and SGLang 0.5.23 read (llama_eagle3.py): fc_norm on, the single norm and post-norm off.
    assert config["fc_norm"] is True and config["norm_before_fc"] is False and config["norm_output"] is False


@torch.no_grad()
def test_an_aux_norm_export_reloads_with_its_norms_and_computes_what_training_computed(normed_export, normed_drafter, tiny_target):
    loaded = load_drafter(normed_export, tiny_target.model_dir)
    assert loaded.config == normed_drafter.config and loaded.config.aux_norm
    for i in range(3):
        assert torch.equal(loaded.fc_norm[i].weight, normed_drafter.fc_norm[i].weight)
    ids = torch.randint(0, normed_drafter.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    aux = torch.randn(2, 12, 3 * 64, generator=torch.Generator().manual_seed(1)) * 20
    for trained, served in zip(ttt_unroll(normed_drafter, ids, aux, 3), ttt_unroll(loaded, ids, aux, 3)):
        torch.testing.assert_close(loaded.logits(served), normed_drafter.logits(trained), rtol=0, atol=0)


def test_verify_export_rejects_an_aux_norm_export_missing_a_norm(normed_export):
    rewrite_weights(normed_export, lambda t: t.pop("fc_norm.1.weight"))
    with pytest.raises(CheckpointFormatError, match=r"fc_norm\.1\.weight missing"):
        verify_export(normed_export)


def published(export, changes: dict) -> None:
    """The export rewritten as a published drafter: no draftline block, config keys changed."""
    config = json.loads((export / "config.json").read_text())
    config.pop("draftline")
    (export / "config.json").write_text(json.dumps({**config, **changes}))


@torch.no_grad()
def test_a_published_drafter_with_fc_norm_loads_with_its_norms(normed_export, normed_drafter, tiny_target):
    published(normed_export, {})
    loaded = load_drafter(normed_export, tiny_target.model_dir)
    assert loaded.config.aux_norm
    aux = torch.randn(1, 4, 3 * 64)
    torch.testing.assert_close(loaded.fuse(aux), normed_drafter.fuse(aux), rtol=0, atol=0)


@pytest.mark.parametrize(("changes", "named"), [
    ({"norm_before_fc": True}, "norm_before_fc"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True,
                       "norm_before_fc": True}}, "norm_before_fc"),  # where both engines read it first
    ({"norm_output": True}, "norm_output"),
    ({"use_aux_norm": True}, "use_aux_norm"),
    ({"fc_norm": "true"}, "fc_norm"),  # on for the engines, which test its truth; off for a drafter reading true
])
@pytest.mark.parametrize("ours", [True, False], ids=["export", "published"])
def test_a_checkpoint_asking_engines_for_a_norm_the_drafter_does_not_compute_is_refused_by_name(exported, tiny_target,
                                                                                              changes, named, ours):
    config = json.loads((exported / "config.json").read_text())
    if ours:
        (exported / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(CheckpointFormatError, match=named):
            verify_export(exported)
    else:
        published(exported, changes)
    with pytest.raises(CheckpointFormatError, match=f"{named} is "):
        load_drafter(exported, tiny_target.model_dir)
