"""A checkpoint holds no pickle: every file it writes is safetensors (an 8-byte header length, a JSON
header, raw tensor bytes) or JSON; none is a pickle (first byte 0x80) or a ``torch.save`` zip of one."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.trainer.checkpoint import Position, load_checkpoint, save_checkpoint
from modeling.eagle3 import DrafterConfig, Eagle3Drafter, KVCache

TORCH_SAVE_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive around a pickle
TINY = DrafterConfig(hidden_size=16, target_hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, vocab_size=40, draft_vocab_size=24, layer_ids=(0, 1, 2))


def stepped() -> tuple[Eagle3Drafter, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A drafter one AdamW step in, so the optimizer has per-parameter state (moments and step counts)."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(TINY)
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    hidden = drafter.fuse(torch.randn(1, 5, 3 * TINY.target_hidden_size))  # (1, 5, H)
    out = drafter(hidden, torch.randint(TINY.vocab_size, (1, 5)), torch.arange(5)[None], KVCache())
    drafter.logits(out).sum().backward()
    optimizer.step()
    scheduler.step()
    return drafter, optimizer, scheduler


def safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    payload = len(raw) - 8 - length
    assert all(meta["data_offsets"][1] <= payload for name, meta in header.items() if name != "__metadata__")
    return header


def test_every_checkpoint_file_is_safetensors_or_json_and_none_unpickles(tmp_path):
    drafter, optimizer, scheduler = stepped()
    path = tmp_path / "step_00000001"
    save_checkpoint(path, drafter=drafter, optimizer=optimizer, scheduler=scheduler, position=Position(1, 0, 1))
    files = sorted(p for p in path.rglob("*") if p.is_file())
    assert [p.name for p in files] == ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    for file in files:
        if file.suffix == ".safetensors":
            header = safetensors_header(file)
            with safe_open(str(file), framework="pt") as handle:
                assert sorted(handle.keys()) == sorted(k for k in header if k != "__metadata__") and handle.keys()
        else:
            json.loads(file.read_text())
        raw = file.read_bytes()
        assert raw[:1] != b"\x80" and not raw.startswith(TORCH_SAVE_MAGIC), f"{file.name} is a pickle"
        with pytest.raises(pickle.UnpicklingError):
            pickle.loads(raw)


def test_the_optimizers_moments_are_tensors_in_safetensors_and_its_step_counts_json(tmp_path):
    drafter, optimizer, scheduler = stepped()
    path = tmp_path / "step_00000001"
    save_checkpoint(path, drafter=drafter, optimizer=optimizer, scheduler=scheduler, position=Position(1, 0, 1))
    header = safetensors_header(path / "optimizer.safetensors")
    assert {"fc.weight/exp_avg", "fc.weight/exp_avg_sq"} <= set(header)
    state = json.loads((path / "state.json").read_text())
    assert state["position"]["step"] == 1 and state["optimizer"]["param_groups"][0]["lr"] == 1e-3
    # And it all comes back: the loaded optimizer holds the saved moments.
    restored, restored_optimizer, restored_scheduler = stepped()
    with torch.no_grad():
        for parameter in restored.trainable_parameters():
            parameter.zero_()
    load_checkpoint(path, drafter=restored, optimizer=restored_optimizer, scheduler=restored_scheduler)
    assert torch.equal(restored.fc.weight, drafter.fc.weight)
    saved = optimizer.state[drafter.fc.weight]["exp_avg"]
    assert torch.equal(restored_optimizer.state[restored.fc.weight]["exp_avg"], saved)
