"""The projection of what a run writes besides hidden states (runtime.disk_training), held to the real drafters and
a real checkpoint written by the trainer."""

from __future__ import annotations

import json

import pytest
import torch

from modeling.dflash import DFlashConfig, DFlashDrafter
from modeling.eagle3 import DrafterConfig, Eagle3Drafter
from runtime import disk_training
from services.trainer.checkpoint import Position, save_checkpoint
from shared.layout import RunPaths
from shared.runspec import DFlashSettings, TrainConfig

# A small Llama-like target with grouped kv heads and a wide MLP, so every term of the formula counts.
TARGET = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 256,
          "vocab_size": 1000, "num_hidden_layers": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 512}
LAYERS = [1, 3, 4]


def real_trained(drafter: torch.nn.Module) -> int:
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def eagle3(train: TrainConfig) -> Eagle3Drafter:
    return Eagle3Drafter(DrafterConfig.from_target_config(TARGET, draft_vocab_size=train.draft_vocab_size,
                                                          layer_ids=LAYERS))


@pytest.mark.parametrize("draft_vocab", [300, 5000])
def test_eagle3_trained_parameters_are_the_modules_own(draft_vocab):
    train = TrainConfig(draft_vocab_size=draft_vocab)
    assert disk_training.trained_params(TARGET, train) == real_trained(eagle3(train))


@pytest.mark.parametrize("layers", [1, 3])
def test_dflash_trained_parameters_are_the_modules_own(layers):
    train = TrainConfig(method="dflash", draft_vocab_size=400, dflash=DFlashSettings(layers=layers))
    base = DrafterConfig.from_target_config(TARGET, draft_vocab_size=400, layer_ids=LAYERS)
    drafter = DFlashDrafter(DFlashConfig(base, num_layers=layers, block_size=4, mask_token_id=7))
    assert disk_training.trained_params(TARGET, train) == real_trained(drafter)


def test_a_checkpoint_measures_what_the_estimate_said_and_the_projection_counts_down_as_files_land(tmp_path):
    train = TrainConfig(draft_vocab_size=300)
    paths = RunPaths(tmp_path, "r")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"text_config": TARGET}))
    config = disk_training.target_config(tmp_path / "model")
    assert config == TARGET
    estimated = disk_training.training_bytes(paths, config, train)

    drafter = eagle3(train)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    # One step on a summed loss fills Adam's moments, as the trainer's first step does.
    sum(p.sum() for p in drafter.parameters() if p.requires_grad).backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_checkpoint(paths.checkpoint(10), drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                    position=Position(step=10, epoch=0, batch_in_epoch=10))
    one = disk_training.tree_bytes(paths.checkpoint(10))
    export = 2 * disk_training.trained_params(TARGET, train) + disk_training.map_bytes(TARGET, train)
    per_checkpoint = (estimated - export) / 3
    assert one == pytest.approx(per_checkpoint, rel=0.05)  # the estimate is the checkpoint the trainer writes

    # Measured now: two more checkpoints and the export to come.
    left = disk_training.training_bytes(paths, config, train)
    assert left == 2 * one + export
    paths.export_dir.mkdir(parents=True)
    (paths.export_dir / "config.json").write_text("{}")
    assert disk_training.training_bytes(paths, config, train) == 0  # the export is whole: training wrote all


def test_without_a_target_config_or_a_checkpoint_nothing_is_projected_for_training(tmp_path):
    assert disk_training.target_config(tmp_path / "missing") is None
    assert disk_training.training_bytes(RunPaths(tmp_path, "r"), None, TrainConfig()) == 0


def test_replies_are_measured_once_written_and_estimated_before():
    assert disk_training.reply_bytes(10, 0, 0, prompt_bytes_per_row=300, max_tokens=64) == 10 * (600 + 12 * 64)
    assert disk_training.reply_bytes(10, 5000, 4, prompt_bytes_per_row=300, max_tokens=64) == 12500
