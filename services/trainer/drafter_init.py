"""The drafter a training session starts from: a fresh EAGLE-3 or DFlash drafter with a draft vocabulary counted
from the run's data, or a published base checkpoint to fine-tune, checked against the target first."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from modeling.dflash import DFlashConfig, DFlashDrafter
from modeling.eagle3 import DrafterConfig, Eagle3Drafter, TargetTied, rope_scaling_of
from modeling.export import load_drafter
from modeling.methods import DFLASH
from modeling.target_head import text_config
from services.trainer.vocab import TokenTally, build_mapping
from shared import eagle3
from shared.drafter_format import TargetFacts, check_base_fits, check_drafter, mapping_tensors, read_config
from shared.errors import BaseCheckpointMismatch, CheckpointFormatError, UnsupportedRopeScaling
from shared.fingerprint import model_fingerprint
from shared.layout import resolve_inside
from shared.runspec import RunSpec, TrainConfig

log = logging.getLogger(__name__)

VOCAB_FROM_BASE = "base checkpoint"  # the base checkpoint's own d2t/t2d, kept as it is
VOCAB_FROM_DATA = "training data"  # the most frequent loss-masked target tokens of this run's files


def expected_layer_ids(spec: RunSpec, target_config: dict) -> list[int]:
    layers = int(text_config(target_config)["num_hidden_layers"])
    ids = spec.extraction.layer_ids or eagle3.default_layer_ids(layers)
    return eagle3.check_layer_ids(list(ids), layers)


def base_checkpoint_dir(data: Path, value: str) -> Path:
    """The base checkpoint's directory on the volume; CheckpointFormatError naming the value otherwise (a
    run submitted with ``force`` can carry any string here: a NUL byte, a 300-character name)."""
    try:
        base = resolve_inside(data, value)
        found = base.is_dir()
    except (ValueError, OSError) as exc:  # PathOutsideVolume is a DraftlineError and passes through
        raise CheckpointFormatError(f"base checkpoint {value[:200]!r}: not a usable path ({exc})") from None
    if not found:
        raise CheckpointFormatError(f"base checkpoint {value!r}: no directory at {base} (download it onto the volume first)")
    return base


def check_base_checkpoint(cfg: TrainConfig, *, data: Path, model_dir: Path, target_config: dict,
                          layer_ids: list[int]) -> Path | None:
    """The base checkpoint's directory once it is a drafter that fits the target (hidden size, vocabulary,
    layers, the recorded fingerprint) and reads this run's layers; None for a run without one. Checked
    before any training, by the job itself, so a mismatch fails the run by name."""
    if not cfg.base_checkpoint:
        return None
    base = base_checkpoint_dir(data, cfg.base_checkpoint)
    config = read_config(base)
    check_drafter(base, config)
    ids = check_base_fits(base, config, TargetFacts.from_config(target_config, model_fingerprint(model_dir)))
    if ids != layer_ids:
        raise BaseCheckpointMismatch(f"base checkpoint {base} reads the outputs of layers {ids}, this run extracted "
                                     f"{layer_ids} (extraction.layer_ids)")
    return base


def draft_vocab_source(cfg: TrainConfig, data: Path) -> str:
    """Where the run's draft vocabulary comes from: a base checkpoint's d2t/t2d, else the training data."""
    if cfg.base_checkpoint and mapping_tensors(base_checkpoint_dir(data, cfg.base_checkpoint)):
        return VOCAB_FROM_BASE
    return VOCAB_FROM_DATA


def data_mapping(tally: TokenTally, config: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The most frequent learned tokens over the rows training reads (each file's first ``max_length``)."""
    return build_mapping(tally.counts, config.draft_vocab_size)


def build_drafter(cfg: TrainConfig, *, data: Path, model_dir: Path, target_config: dict, layer_ids: list[int],
                  embed: torch.Tensor, tally: TokenTally) -> tuple[TargetTied, str]:
    """A fresh drafter with a draft vocabulary from the training files, or the base checkpoint with its own
    (one from the files if it has none); and where the vocabulary came from."""
    if cfg.method == DFLASH:
        return build_dflash(cfg, target_config=target_config, layer_ids=layer_ids, embed=embed,
                            tally=tally), VOCAB_FROM_DATA
    base = check_base_checkpoint(cfg, data=data, model_dir=model_dir, target_config=target_config, layer_ids=layer_ids)
    if base is None:
        config = DrafterConfig.from_target_config(target_config, draft_vocab_size=cfg.draft_vocab_size, layer_ids=layer_ids,
                                                  aux_norm=cfg.aux_norm)
        drafter = Eagle3Drafter(config)
        drafter.load_embedding(embed)
        drafter.set_vocab_mapping(*data_mapping(tally, config))
        return drafter, VOCAB_FROM_DATA
    drafter = load_drafter(base, model_dir, embed=embed)
    warn_on_rope_difference(base, drafter.config, target_config)
    if draft_vocab_source(cfg, data) == VOCAB_FROM_BASE:
        log.info("fine-tuning %s, keeping its draft vocabulary of %d", base, drafter.config.draft_vocab_size)
        return drafter, VOCAB_FROM_BASE
    drafter.set_vocab_mapping(*data_mapping(tally, drafter.config))
    log.warning("fine-tuning %s: it has no d2t/t2d, so its draft vocabulary of %d is computed from this run's %d "
                "training files; its lm_head rows are taken to follow that mapping", base,
                drafter.config.draft_vocab_size, tally.files)
    return drafter, VOCAB_FROM_DATA


def build_dflash(cfg: TrainConfig, *, target_config: dict, layer_ids: list[int], embed: torch.Tensor,
                 tally: TokenTally) -> DFlashDrafter:
    """A fresh DFlash drafter of the target's width over the same auxiliary layers as EAGLE-3, its draft
    vocabulary and mask token taken from the training files."""
    base = DrafterConfig.from_target_config(target_config, draft_vocab_size=cfg.draft_vocab_size, layer_ids=layer_ids)
    settings = cfg.dflash
    mask = settings.mask_token_id if settings.mask_token_id is not None else tally.unused()
    config = DFlashConfig(base, num_layers=settings.layers, block_size=settings.block_size, mask_token_id=mask,
                          causal=settings.causal)
    drafter = DFlashDrafter(config)
    drafter.load_embedding(embed)
    drafter.set_vocab_mapping(*data_mapping(tally, base))
    log.info("DFlash drafter: %d layers, blocks of %d (%s), mask token %d, %d anchors a sample", config.num_layers,
             config.block_size, "causal" if config.causal else "bidirectional", mask, settings.anchors)
    return drafter


def warn_on_rope_difference(base: Path, config: DrafterConfig, target_config: dict) -> None:
    """A base keeps its own RoPE and length (its weights learned them); say so when the target's differ."""
    text = text_config(target_config)
    ours = (config.rope_scaling, config.max_position_embeddings)
    try:
        target_rope = rope_scaling_of(text)
    except UnsupportedRopeScaling:
        target_rope = text.get("rope_scaling") or text.get("rope_parameters")
    theirs = (target_rope, int(text.get("max_position_embeddings", config.max_position_embeddings)))
    if ours != theirs:
        log.warning("base checkpoint %s has rope_scaling %s and max_position_embeddings %d, the target %s and %d; "
                    "the drafter keeps the base's", base, ours[0], ours[1], theirs[0], theirs[1])
