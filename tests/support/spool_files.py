"""Hidden-state files as an extractor leaves them for an online trainer: written, recorded in their shard's manifest
and counted (the done bit and the spool's bytes), so the trainer's feed finds them ready. For the feed's tests, the
online source's, and bench/bench_feed_step.py."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

from runtime.disk import landed_counts
from runtime.runstate import RunState
from shared import eagle3
from shared.lifecycle import Stage
from shared.manifest import ManifestEntry, append_entry, manifest_path


def land(state: RunState, sample_id: int, tokens: int, *, hidden: int | None = None) -> int:
    """Sample ``sample_id``'s file of ``tokens`` tokens, recorded and counted; its bytes. Without ``hidden`` it holds
    what the feed reads (ids, mask, a two-wide last state); with it, a whole sample a batch is read from (the three
    layers and the last, ``hidden`` wide, drawn from the sample id)."""
    path = state.paths.hidden(sample_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    if hidden is None:
        layers = [0]
        tensors = {eagle3.INPUT_IDS: np.zeros(tokens, dtype=np.int64), eagle3.LOSS_MASK: np.ones(tokens, dtype=np.uint8),
                   eagle3.LAST_HIDDEN: np.zeros((tokens, 2), dtype=np.float32)}
    else:
        layers, rng = [0, 1, 2], np.random.default_rng(sample_id)
        tensors = {eagle3.INPUT_IDS: rng.integers(0, 100, tokens, dtype=np.int64),
                   eagle3.LOSS_MASK: (rng.random(tokens) > 0.3).astype(np.uint8),
                   eagle3.AUX_HIDDEN: rng.standard_normal((tokens, 3 * hidden), dtype=np.float32),
                   eagle3.LAST_HIDDEN: rng.standard_normal((tokens, hidden), dtype=np.float32)}
    save_file(tensors, str(path), metadata={eagle3.META_LAYER_IDS: str(layers)})
    size = path.stat().st_size
    append_entry(manifest_path(state.paths, sample_id),
                 ManifestEntry(sample_id, "0" * 64, size, tokens, "F32", layers, 0.0, path.stat().st_mtime_ns))
    state.mark_done(Stage.EXTRACT, sample_id, landed=landed_counts(size, tokens))
    return size
