"""Make a target model directory once: SmolLM2 converted from its shipped GGUF, or the tiny built-in one.

``ensure_target(name, directory)`` returns a finished directory that a plain ``from_pretrained(path)``
loads, making it first where none is. A conversion reads the GGUF with transformers' own GGUF loader,
copies the dequantized weights into an ordinary model, saves it as safetensors, reloads that through a
plain ``from_pretrained`` and checks it against the GGUF-loaded model: the architecture, the end-of-turn
token, and logits on a fixed chat prompt, bit for bit. Only then is the directory published.

Publication: everything is written into a temp directory next to the destination, with the marker
(``shared/targets.py``) last; every file and the directory are fsynced; one rename publishes it. An
interrupted conversion leaves a temp directory that the next call removes, never a directory that
looks finished. A lock on the parent directory keeps two processes from converting at once.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from shared.atomic import TEMP_PREFIX, atomic_write_json, fsync_dir
from shared.errors import TargetDirOccupied, TargetVerificationError
from shared.targets import (
    GGUF_TARGETS,
    MARKER,
    TARGET_NAMES,
    TINY,
    GGUFSource,
    ModelFacts,
    facts_dict,
    is_finished,
    marker_body,
    read_marker,
    verified_gguf,
)

log = logging.getLogger(__name__)

# The prompt whose logits must match between the GGUF-loaded model and the converted one.
CHECK_MESSAGES = ({"role": "user", "content": "What is the capital of France? Answer in one sentence."},)
# Q4_1 weights dequantize to scale * q + min in float32; most of those values have no exact bfloat16 or
# float16 form, so only float32 keeps the converted model's logits equal to the GGUF-loaded model's,
# which is what the verification compares. The inference server still casts to its own dtype on load.
STORE_DTYPE = "float32"
VERSIONED_LIBRARIES = ("torch", "transformers", "gguf")


@dataclass(frozen=True)
class Reference:
    """The GGUF-loaded model's output on the check prompt: what the converted directory must reproduce."""

    input_ids: list[int]
    logits: Any  # torch.Tensor (1, T, vocab), float32


def ensure_target(name: str, directory: Path) -> Path:
    """A finished target ``name`` (``smollm2`` or ``tiny``) in ``directory``, made first if none is there."""
    if name == TINY:
        return ensure_tiny_target(directory)
    if name not in GGUF_TARGETS:
        raise ValueError(f"unknown target {name!r}: choose one of {', '.join(TARGET_NAMES)}")
    return ensure_gguf_target(GGUF_TARGETS[name], directory)


def ensure_gguf_target(source: GGUFSource, directory: Path) -> Path:
    return _ensure(Path(directory), source.name, source.identity(), lambda tmp: convert_gguf(source, tmp))


def ensure_tiny_target(directory: Path) -> Path:
    return _ensure(Path(directory), TINY, tiny_identity(), _build_tiny)


def _ensure(directory: Path, target: str, source: dict[str, str], build: Callable[[Path], dict]) -> Path:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.parent):
        if is_finished(directory, target, source):
            log.info("target %s: reusing %s (%s)", target, directory, _describe(source))
            return directory
        _check_replaceable(directory)
        for stale in directory.parent.glob(f"{TEMP_PREFIX}{directory.name}.*"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        tmp = directory.parent / f"{TEMP_PREFIX}{directory.name}.{uuid.uuid4().hex[:8]}"
        try:
            details = build(tmp)
            atomic_write_json(tmp / MARKER, marker_body(target, source, tmp, **details))
            _fsync_tree(tmp)
            _publish(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("target %s: made %s in %.1f s (%s)", target, directory, time.monotonic() - started, _describe(source))
    return directory


def _describe(source: dict[str, str]) -> str:
    if "package" in source:
        return f"from {source['package']} {source['version']}, sha256 {source['sha256'][:12]}"
    return f"built by {source['builder']}, sha256 {source['sha256'][:12]}"


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes
        yield
    finally:
        os.close(fd)


def _check_replaceable(directory: Path) -> None:
    """Refuse to replace a directory that draftline did not make (an older conversion of ours is replaced)."""
    if not directory.exists() or read_marker(directory) is not None:
        return
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
        return
    raise TargetDirOccupied(f"{directory} exists and is not a target draftline made: remove it or choose another "
                            "directory")


def _fsync_tree(root: Path) -> None:
    """``save_pretrained`` does not fsync; the rename must publish whole files."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        else:
            fsync_dir(path)
    fsync_dir(root)


def _publish(tmp: Path, directory: Path) -> None:
    """Rename ``tmp`` to ``directory``; an older directory is moved aside first, then removed."""
    old = None
    if directory.exists():
        old = directory.parent / f"{TEMP_PREFIX}{directory.name}.old.{uuid.uuid4().hex[:8]}"
        log.warning("replacing %s (made from another source: %s)", directory, (read_marker(directory) or {}).get("source"))
        os.rename(directory, old)
    os.rename(tmp, directory)
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- SmolLM2 from its GGUF -------------------------------------------------------------------------
def convert_gguf(source: GGUFSource, out_dir: Path) -> dict[str, Any]:
    """Write ``source`` as a float32 safetensors model directory into ``out_dir`` and verify it there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = verified_gguf(source)
    log.info("converting %s (%s %s) into %s", gguf.name, source.package, source.version, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    reference = reference_output(loaded, tokenizer)
    model = plain_copy(loaded, tokenizer, source.facts)
    del loaded
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unbounded
    # transformers versions read the GGUF's eos differently (5.17 takes <|im_start|>, 5.24 <|im_end|>); the
    # target ends its turns with the end-of-turn token, so that is the eos the directory records.
    tokenizer.eos_token = source.facts.end_of_turn
    out_dir.mkdir(parents=True)
    save_model(model, tokenizer, out_dir)
    verify_target(out_dir, source.facts, reference)
    return {"dtype": STORE_DTYPE, "facts": facts_dict(source.facts),
            "converted_with": {name: metadata.version(name) for name in VERSIONED_LIBRARIES}}


def reference_output(model, tokenizer) -> Reference:
    import torch

    ids = check_prompt_ids(tokenizer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits  # (1, T, vocab)
    return Reference(input_ids=ids, logits=logits)


def check_prompt_ids(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(list(CHECK_MESSAGES), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def plain_copy(loaded, tokenizer, facts: ModelFacts):
    """The GGUF-loaded model's weights in an ordinary model: the loader marks its model as GGUF-quantized,
    which ``save_pretrained`` refuses to write, though the weights are already dequantized float32."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = copy.deepcopy(loaded.config)
    for attribute in ("quantization_config", "_model_name_or_path"):  # the GGUF's loader state and title
        if hasattr(config, attribute):
            delattr(config, attribute)
    end_of_turn = tokenizer.convert_tokens_to_ids(facts.end_of_turn)
    config.eos_token_id = end_of_turn
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=end_of_turn,
                                               pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def save_model(model, tokenizer, out_dir: Path) -> None:
    model.save_pretrained(out_dir)  # safetensors
    tokenizer.save_pretrained(out_dir)


def verify_target(directory: Path, facts: ModelFacts, reference: Reference) -> None:
    """Reload ``directory`` through plain ``from_pretrained`` and raise unless it is the model ``reference`` came from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    problems = _fact_problems(model, tokenizer, facts)
    if not tokenizer.chat_template:
        problems.append("no chat template")
    elif (ids := check_prompt_ids(tokenizer)) != reference.input_ids:
        problems.append("the chat template renders the check prompt differently from the GGUF's")
    else:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits
        if not torch.equal(logits, reference.logits):
            diff = (logits - reference.logits).abs().max().item()
            problems.append(f"logits on the check prompt differ from the GGUF-loaded model's (max {diff:.3g})")
    if problems:
        raise TargetVerificationError(f"{directory}: " + "; ".join(problems))


def _fact_problems(model, tokenizer, facts: ModelFacts) -> list[str]:
    import torch

    config = model.config
    found = {
        "architecture": type(model).__name__,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "tied_embeddings": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "end_of_turn": tokenizer.eos_token,
    }
    problems = [f"{key} is {value!r}, not {getattr(facts, key)!r}" for key, value in found.items()
                if value != getattr(facts, key)]
    end_of_turn = tokenizer.convert_tokens_to_ids(facts.end_of_turn)
    stops = model.generation_config.eos_token_id
    if end_of_turn not in (stops if isinstance(stops, list) else [stops]):
        problems.append(f"generation_config.eos_token_id {stops!r} does not stop at {facts.end_of_turn} ({end_of_turn})")
    if next(model.parameters()).dtype != getattr(torch, STORE_DTYPE):
        problems.append(f"weights are {next(model.parameters()).dtype}, not {STORE_DTYPE}")
    return problems


# ---- the tiny built-in target ----------------------------------------------------------------------
def tiny_identity() -> dict[str, str]:
    """The tiny target's source: the digest of the code and the prompts its builder reads."""
    from services.cli import tiny_model

    digest = hashlib.sha256(Path(tiny_model.__file__).read_bytes())
    digest.update(resources.files("shared").joinpath("data/demo_prompts.jsonl").read_bytes())
    return {"builder": "services.cli.tiny_model", "sha256": digest.hexdigest()}


def _build_tiny(out_dir: Path) -> dict[str, Any]:
    from services.cli.tiny_model import make_tiny_model

    make_tiny_model(out_dir)
    return {"built_with": {name: metadata.version(name) for name in ("torch", "transformers", "tokenizers")}}
