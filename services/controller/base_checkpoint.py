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
from shared.drafter_format import check_drafter, read_config
from shared.errors import CheckpointFormatError, DraftlineError

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


def verify_checkpoint(path: Path, card: dict | None) -> str:
    """The trainer's own checks (``shared.drafter_format``); CheckpointFormatError if anything is missing
    or does not fit the served target."""
    config = read_config(path)
    try:
        check_drafter(path, config)
    except KeyError as exc:
        raise CheckpointFormatError(f"{path / 'config.json'}: {exc.args[0]} missing") from None
    target = (card or {}).get("draftline") or {}
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    problems = []
    if target.get("hidden_size") and hidden != target["hidden_size"]:
        problems.append(f"drafts for hidden size {hidden}, the served target has {target['hidden_size']}")
    if target.get("vocab_size") and config.get("vocab_size") != target["vocab_size"]:
        problems.append(f"vocabulary {config.get('vocab_size')}, the served target's is {target['vocab_size']}")
    if problems:
        raise CheckpointFormatError("; ".join(problems))
    return f"hidden size {hidden}, draft vocabulary {config.get('draft_vocab_size')}"
