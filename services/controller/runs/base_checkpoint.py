"""A base drafter checkpoint for fine-tuning: fetched from the Hugging Face Hub onto the volume (the
trainer reads base checkpoints from the volume only) and verified with the trainer's own checks
(``shared.drafter_format``, torch-free).

A repo ``owner/name`` lands in ``<volume>/models/drafters/owner--name``, copied out of the Hub cache into
a temp directory that is renamed into place, so a half copy never looks finished.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from shared.atomic import TEMP_PREFIX, fsync_dir
from shared.drafter_format import TargetFacts, check_base_fits, check_drafter, mapping_tensors, read_config
from shared.errors import DraftlineError

log = logging.getLogger(__name__)

CHECKPOINT_FILES = ["config.json", "*.safetensors", "*.json"]
DRAFTERS_DIR = Path("models") / "drafters"


def hub_checkpoint_dir(data: Path, repo_id: str) -> Path:
    """Where a Hub checkpoint lands on the volume: ``models/drafters/<owner>--<name>``."""
    return Path(data) / DRAFTERS_DIR / repo_id.replace("/", "--")


class CheckpointFetchError(DraftlineError):
    """A base checkpoint named by repo id cannot be fetched from the Hugging Face Hub."""


def fetch_checkpoint(data: Path, repo_id: str) -> Path:
    """``snapshot_download`` the repo (or take it from the Hub cache offline), then publish a copy on the
    volume atomically: a temp directory renamed into place, so a half copy never looks finished."""
    from huggingface_hub import snapshot_download

    target = hub_checkpoint_dir(data, repo_id)
    if target.is_dir():
        return target
    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES))
    except (OSError, ValueError) as exc:  # the Hub's errors: not cached offline, no such repo, no access, bad id
        raise CheckpointFetchError(f"base checkpoint {repo_id!r} is not on the volume and cannot be fetched from "
                                   f"the Hugging Face Hub ({type(exc).__name__}: {exc})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{TEMP_PREFIX}{target.name}.{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(snapshot, tmp, symlinks=False, ignore=shutil.ignore_patterns(".cache"))
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    log.info("base checkpoint %s fetched to %s", repo_id, target)
    return target


def served_target(card: dict | None) -> TargetFacts:
    """What the served target's card says about it (the built-in server's ``draftline`` block; vLLM's and
    SGLang's cards say nothing, and nothing is then compared)."""
    served = (card or {}).get("draftline") or {}
    number = lambda key: served[key] if isinstance(served.get(key), int) and not isinstance(served[key], bool) else None  # noqa: E731
    fingerprint = served.get("fingerprint") if isinstance(served.get("fingerprint"), str) else None
    return TargetFacts(number("hidden_size"), number("vocab_size"), number("num_layers"), fingerprint)


def verify_checkpoint(path: Path, card: dict | None) -> str:
    """The trainer's own checks (``shared.drafter_format``): the format, then the fit to the served target;
    CheckpointFormatError (BaseCheckpointMismatch for a misfit) naming what is wrong."""
    config = read_config(path)
    check_drafter(path, config)
    ids = check_base_fits(path, config, served_target(card))
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    vocab = ("its own d2t/t2d" if mapping_tensors(path)
             else "no d2t/t2d: the trainer computes the draft vocabulary from the run's data")
    layers = f", layer outputs {ids}" if ids else ""
    return f"hidden size {hidden}, draft vocabulary {config.get('draft_vocab_size') or config.get('vocab_size')} ({vocab}){layers}"
