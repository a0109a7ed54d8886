"""Training checkpoints: model, optimizer, scheduler, RNG and data position, as safetensors plus JSON.

A checkpoint directory is written under a temp name and renamed into place, so ``latest_checkpoint``
only ever finds complete ones; a crash mid-save leaves a temp directory that the next save removes.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shared import SCHEMA_VERSION
from shared.atomic import TEMP_PREFIX, atomic_dir, atomic_write_json, read_json
from shared.errors import CheckpointFormatError
from shared.layout import CHECKPOINT_RE
from modeling.methods import config_from_dict
from modeling.tensor_files import write_safetensors
from modeling.eagle3 import TargetTied

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"
KEEP_CHECKPOINTS = 2


@dataclass(frozen=True)
class Position:
    """Where training stands: optimizer steps taken, the next batch of which epoch, and the training time
    spent so far (so ``elapsed_s`` in the log keeps counting across a resume instead of restarting)."""

    step: int
    epoch: int
    batch_in_epoch: int
    elapsed_s: float = 0.0


def remove_stale_temp_dirs(parent: Path) -> None:
    if parent.is_dir():
        for path in parent.iterdir():
            if path.name.startswith(TEMP_PREFIX) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


# ---- optimizer and scheduler state as tensors + JSON (no pickle on the volume) -------------------

def optimizer_to_files(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            slot = f"{names[index]}/{key}"
            if isinstance(value, torch.Tensor):
                tensors[slot] = value
            else:
                scalars[slot] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_files(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    index_of = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for slot, value in [*tensors.items(), *meta["scalars"].items()]:
        name, key = slot.rsplit("/", 1)
        if name not in index_of:
            raise CheckpointFormatError(f"optimizer state names unknown parameter {name!r}")
        state.setdefault(index_of[name], {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> dict[str, torch.Tensor]:
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def restore_rng(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    cuda = [states[k] for k in sorted(states) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# ---- save / find / load --------------------------------------------------------------------------

def save_checkpoint(
    path: Path,
    *,
    drafter: TargetTied,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    position: Position,
    extra: dict[str, Any] | None = None,
) -> None:
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    opt_tensors, opt_meta = optimizer_to_files(optimizer, names)
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    state = {
        "schema_version": SCHEMA_VERSION,
        "position": asdict(position),
        "config": drafter.config.to_dict(),
        "optimizer": opt_meta,
        "scheduler": sched,
        **(extra or {}),
    }
    remove_stale_temp_dirs(Path(path).parent)
    with atomic_dir(path) as tmp:
        write_safetensors(tmp / MODEL_FILE, drafter.checkpoint_state())
        write_safetensors(tmp / OPTIMIZER_FILE, opt_tensors)
        write_safetensors(tmp / RNG_FILE, rng_state())
        atomic_write_json(tmp / STATE_FILE, state)
    log.info("checkpoint %s saved", path)
    prune_checkpoints(Path(path).parent, keep=KEEP_CHECKPOINTS)


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    if not Path(directory).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def prune_checkpoints(directory: Path, keep: int) -> None:
    for _, path in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointFormatError(f"{path}: no {STATE_FILE}")
    return read_json(file)


def load_weights(path: Path, drafter: TargetTied) -> dict[str, Any]:
    """Load a checkpoint's weights into ``drafter``, whose config must be the one saved; returns the state."""
    path = Path(path)
    state = read_checkpoint_state(path)
    try:
        saved = config_from_dict(state["config"]).to_dict()  # fields added since it was saved take their defaults
    except (TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: drafter config {state['config']} is not one this trainer builds ({exc})") from None
    if saved != drafter.config.to_dict():
        raise CheckpointFormatError(f"{path}: drafter config {saved} differs from this run's {drafter.config.to_dict()}")
    missing, unexpected = drafter.load_state_dict(load_file(path / MODEL_FILE), strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise CheckpointFormatError(f"{path}: missing {missing}, unexpected {unexpected}")
    return state


def load_checkpoint(
    path: Path,
    *,
    drafter: TargetTied,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> Position:
    """Restore everything ``save_checkpoint`` wrote; the drafter's config must be the one saved."""
    path = Path(path)
    state = load_weights(path, drafter)
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    optimizer_from_files(optimizer, names, load_file(path / OPTIMIZER_FILE), state["optimizer"])
    scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
    restore_rng(load_file(path / RNG_FILE))
    log.info("resumed from %s", path)
    return Position(**state["position"])
