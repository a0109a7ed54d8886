import json
import shutil
from pathlib import Path

import pytest
import torch

from services.inference.model import load_model, model_fingerprint, resolve_device, resolve_dtype, safetensors_dtype
from shared import eagle3
from shared.settings import InferenceSettings


def test_fingerprint_ignores_key_order_and_whitespace_but_not_values(tiny_model_dir: Path, tmp_path: Path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    reordered = tmp_path / "reordered"
    reordered.mkdir()
    (reordered / "config.json").write_text(json.dumps(dict(reversed(list(config.items()))), indent=7))
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 9}))

    original = model_fingerprint(tiny_model_dir)
    assert len(original) == 64
    assert model_fingerprint(reordered) == original
    assert model_fingerprint(changed) != original


def test_loaded_target_reports_its_shape_eos_and_context(loaded_tiny, tiny_model_dir: Path):
    tokenizer = loaded_tiny.tokenizer
    assert loaded_tiny.name == tiny_model_dir.name
    assert loaded_tiny.fingerprint == model_fingerprint(tiny_model_dir)
    assert (loaded_tiny.num_layers, loaded_tiny.hidden_size) == (8, 64)
    assert loaded_tiny.default_layer_ids() == eagle3.default_layer_ids(8) == [1, 3, 4]
    # generation_config lists [im_end, pad]; the tokenizer's eos (im_end) joins them.
    assert loaded_tiny.eos_token_ids == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert loaded_tiny.context_length == 4096
    assert loaded_tiny.knows_think_close
    assert (loaded_tiny.device.type, loaded_tiny.dtype, loaded_tiny.dtype_name) == ("cpu", torch.float32, "F32")


def test_model_name_setting_and_integer_eos_in_generation_config(tiny_model_dir: Path, tmp_path: Path):
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    generation = json.loads((copy / "generation_config.json").read_text())
    generation["eos_token_id"] = 0
    (copy / "generation_config.json").write_text(json.dumps(generation))

    loaded = load_model(InferenceSettings(model_dir=copy, model_name="served-name", device="cpu"))
    assert loaded.name == "served-name"
    assert loaded.eos_token_ids == {0, loaded.tokenizer.eos_token_id}


def test_server_stops_on_the_templates_end_of_turn_where_no_eos_names_it(tiny_model_dir: Path, tmp_path: Path):
    # A ChatML target whose tokenizer and generation_config name only <|endoftext|> (as a base model's do):
    # its chat replies still end with the <|im_end|> the template closes assistant turns with.
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    for name, key in (("tokenizer_config.json", "eos_token"), ("generation_config.json", "eos_token_id")):
        config = json.loads((copy / name).read_text())
        config[key] = "<|endoftext|>" if key == "eos_token" else 0
        (copy / name).write_text(json.dumps(config))

    loaded = load_model(InferenceSettings(model_dir=copy, device="cpu"))
    tokenizer = loaded.tokenizer
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert loaded.eos_token_ids == {0, tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_auto_device_and_dtype_follow_the_hardware():
    cuda = torch.cuda.is_available()
    assert resolve_device("auto").type == ("cuda" if cuda else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_safetensors_dtype_names_and_refusal():
    assert [safetensors_dtype(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["F32", "BF16", "F16"]
    with pytest.raises(ValueError, match="not supported"):
        safetensors_dtype(torch.float64)


@pytest.fixture
def cudnn_attention_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_is_switched_off_and_the_other_kernels_stay(cudnn_attention_restored):
    from modeling.attention import avoid_cudnn_attention
    from services.trainer.session import pick_device

    torch.backends.cuda.enable_cudnn_sdp(True)
    pick_device("cpu")  # CPU work leaves the process-wide switch alone
    assert torch.backends.cuda.cudnn_sdp_enabled()
    avoid_cudnn_attention()
    avoid_cudnn_attention()  # a second start in the same process changes nothing
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
