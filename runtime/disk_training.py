"""What a run writes besides its hidden states, projected: replies, training checkpoints and the export.

Hidden states dominate a run's bytes, but a run whose volume holds its states can still die writing a
checkpoint. The projection therefore counts every writer of the run (``runtime.disk.assess``):

    replies   = samples still to generate × reply bytes per sample
                (measured: generated_bytes / replies written; before any: 2 × prompt bytes per row
                 + 12 bytes per token of generation.max_tokens, the text and its token ids in JSON)
    training  = 3 checkpoints + the export - what of them is already written
                checkpoint = 12 bytes per trained parameter (fp32 weights, Adam's two moments) + the
                             vocabulary maps; measured from the latest checkpoint once one exists
                export     = 2 bytes per trained parameter (bf16) + the maps; 0 once it is written

Three checkpoints: the trainer keeps two (``KEEP_CHECKPOINTS``) and writes the next before pruning the
oldest. The trained parameters follow the drafter's shape from the target's ``config.json``
(``trained_params``; a test holds them to the real modules). Everything here is torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.drafter_format import CONFIG_FILE
from shared.layout import RunPaths
from shared.runspec import TrainConfig

CHECKPOINTS_AT_ONCE = 3  # two kept and the next being written
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and Adam's exp_avg and exp_avg_sq
EXPORT_BYTES_PER_PARAM = 2  # bf16, what the engines load
REPLY_BYTES_PER_TOKEN = 12  # a reply token's text and its id, in the reply record's JSON
REPLY_PROMPT_FACTOR = 2  # the record repeats the prompt, with the chat's framing


def target_config(model_dir: Path | None) -> dict | None:
    """The target's config (its text model's, for a multimodal one); None when it cannot be read."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("text_config") or config if isinstance(config, dict) else None


def trained_params(config: dict, train: TrainConfig) -> int:
    """Parameters the trainer updates (the frozen embedding aside), from the target's config and the recipe."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("v_head_dim") or config.get("head_dim") or h // heads)
    inter = int(config.get("intermediate_size") or 4 * h)
    draft_vocab = min(train.draft_vocab_size, int(config["vocab_size"]))
    mlp = 3 * h * inter
    if train.method == "dflash":
        # Each layer reads the hidden width; one k_norm serves every layer, one norm the fused context.
        attention = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
        layers = train.dflash.layers * (attention + mlp + 2 * h + head_dim) + head_dim + h
    else:
        # One layer over [embedding; hidden], twice the width in q, k and v; two input norms and one after.
        attention = 2 * h * heads * head_dim + 2 * 2 * h * kv * head_dim + heads * head_dim * h
        layers = attention + mlp + 3 * h
    return 3 * h * h + layers + h + h * draft_vocab  # fc over three layers, the layers, the norm, lm_head


def map_bytes(config: dict, train: TrainConfig) -> int:
    """The draft vocabulary's maps: d2t as int64 per draft id, t2d as one bool per target id."""
    vocab = int(config["vocab_size"])
    return 8 * min(train.draft_vocab_size, vocab) + vocab


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is missing)."""
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def training_bytes(paths: RunPaths, config: dict | None, train: TrainConfig) -> int:
    """Bytes the run's training and export still have to write; 0 once the export is whole, or when the
    target's config is unknown and no checkpoint exists to measure."""
    export_dir = paths.export_dir
    if (export_dir / CONFIG_FILE).is_file():  # an export appears whole, in one rename
        return 0
    steps = paths.checkpoint_steps()
    params = trained_params(config, train) if config else None
    if steps:
        checkpoint = tree_bytes(paths.checkpoint(steps[-1]))
    elif params is not None:
        checkpoint = CHECKPOINT_BYTES_PER_PARAM * params + map_bytes(config, train)
    else:
        return 0
    export = (EXPORT_BYTES_PER_PARAM * params + map_bytes(config, train) if params is not None
              else checkpoint // (CHECKPOINT_BYTES_PER_PARAM // EXPORT_BYTES_PER_PARAM))
    written = tree_bytes(paths.checkpoints_dir) + tree_bytes(export_dir)
    return max(CHECKPOINTS_AT_ONCE * checkpoint + export - written, 0)


def reply_bytes(remaining: int, written_bytes: float, written: int, *, prompt_bytes_per_row: float,
                max_tokens: int) -> int:
    """Bytes the ``remaining`` replies still to generate need: measured per reply once any is written."""
    if written_bytes > 0 and written > 0:
        return int(remaining * written_bytes / written)
    return int(remaining * (REPLY_PROMPT_FACTOR * prompt_bytes_per_row + REPLY_BYTES_PER_TOKEN * max_tokens))
