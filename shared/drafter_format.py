"""The drafter checkpoint format that vLLM and SGLang load as ``LlamaForCausalLMEagle3``, and its checks.

torch-free (headers and the small mapping tensors are read with numpy), so the controller checks a base
checkpoint at preflight without the trainer's imports; the trainer writes exports and verifies them here.

Layer ids. draftline records auxiliary layers as *outputs of 0-indexed decoder layers*
(``shared.eagle3.LAYER_CONVENTION``; HF ``hidden_states[i + 1]``). The engines read the ids differently:

- SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures at the *input* of
  layer ``id + 1`` (``set_eagle3_layers_to_capture``: ``layers_to_capture = [val + 1 ...]``), i.e. the
  output of layer ``id``: the same convention as ours, so it gets our ids unchanged.
- vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` first and falls back to ``eagle_config``;
  its target models capture ``hidden_states + residual`` *before* running layer ``id`` (the input of
  layer ``id`` = the output of layer ``id - 1``). So vLLM needs our ids **plus one**, written top-level
  where it looks first and SGLang never looks.

With no ids at all both engines fall back to ``(2, N//2, N-3)`` in their own terms, which is our default
``[1, N//2 - 1, N - 4]``; writing the ids explicitly keeps non-default choices correct too. A vLLM
build that only reads ``eagle_config`` would be one layer off; ``verify_export`` pins both fields.

Reading a checkpoint back, ``layer_ids_of`` is the one place that turns a config's ids into ours:
draftline's record, else ``eagle_config``'s (SGLang's, ours unchanged), else the top-level field (vLLM's,
minus one). A published config that carries both engine fields must have them agree (top-level = ours + 1),
or the two engines would read different layers.

Norm switches. Both engines read three config keys that change what the drafter computes, all false when
absent (vLLM 0.32 ``model_executor/models/llama_eagle3.py``; SGLang 0.5.23 ``srt/models/llama_eagle3.py``):

- ``fc_norm``: one RMSNorm per auxiliary state (``fc_norm.0/1/2.weight``, of the target's width) before ``fc``,
  EAGLE-3.1's normalized features. draftline trains it (``train.aux_norm``) and writes it true or false.
- ``norm_before_fc`` (read from ``eagle_config`` first, then the top level): one RMSNorm over the concatenated
  states (``input_norm.weight``), the gpt-oss drafters' form. draftline does not compute it.
- ``norm_output``: the next chain step gets the post-norm state. draftline does not compute it.

A checkpoint that sets either of the last two, or ``use_aux_norm`` (SGLang's older name for ``fc_norm``, which
vLLM does not read), would be served otherwise than draftline trains or evaluates it, so it is refused by name.
An engine build older than these that does not know ``fc_norm`` loads such an export without an error and
serves it without the norm (SGLang skips weight names it does not know); README, "Training objectives and
normalized features", names the versions checked.

A base checkpoint for fine-tuning is a draftline export or a published drafter: the engines' layout with no
``draftline`` block, any float dtype, maybe its own ``embed_tokens``, maybe no ``d2t``/``t2d``.
``check_base_fits`` compares it with the target before any training starts.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared import eagle3
from shared.errors import BaseCheckpointMismatch, CheckpointFormatError

ARCHITECTURE = "LlamaForCausalLMEagle3"
DFLASH_ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry name for its qwen3_dflash drafter (docs/dflash.md)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# config.json's torch_dtype name -> the safetensors dtype code its float tensors carry
FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
CONFIG_TYPES: dict[str, type | tuple[type, ...]] = {
    "architectures": list, "model_type": str, "num_hidden_layers": int, "hidden_size": int,
    "intermediate_size": int, "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "rms_norm_eps": (int, float), "rope_theta": (int, float), "max_position_embeddings": int,
    "vocab_size": int, "draft_vocab_size": int, "tie_word_embeddings": bool, "target_hidden_size": int,
    "eagle_config": dict, "torch_dtype": str, "draftline": dict, "rope_scaling": (dict, type(None)),
}
MAPPING_TENSORS = ("d2t", "t2d")
FC_NORM = "fc_norm"  # the engines' switch for EAGLE-3.1's per-layer norm of the auxiliary states before fc
AUX_LAYERS = 3  # low, middle and high auxiliary states, concatenated in that order before fc
# Config switches the engines read for norms the drafter does not compute, with what each would change.
UNSERVED_NORMS = {
    "norm_before_fc": "one RMSNorm over the concatenated auxiliary states before fc (input_norm.weight)",
    "norm_output": "the post-norm hidden state fed to the next chain step",
    "use_aux_norm": "SGLang's older name for fc_norm, which vLLM does not read (write fc_norm instead)",
}
VLLM_IDS = "eagle_aux_hidden_state_layer_ids"  # top level: vLLM's, HF hidden-states index (ours + 1)
SGLANG_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"  # SGLang's, our convention


def speculative_method(config: dict[str, Any]) -> str:
    """The ``method`` of vLLM's ``--speculative-config`` that serves a drafter of this config."""
    return "dflash" if config.get("architectures") == [DFLASH_ARCHITECTURE] else "eagle3"


def vllm_layer_ids(layer_ids: list[int]) -> list[int]:
    """vLLM's id for each of our layers: it captures the input of layer ``id``, we mean the output."""
    return [int(i) + 1 for i in layer_ids]


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Every tensor the engines need, with its shape; dtype None means "the float dtype of the config"."""
    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    ht = config.get("target_hidden_size") or h
    aux_norms = {f"{FC_NORM}.{i}.weight": ((ht,), None) for i in range(AUX_LAYERS)} if config.get(FC_NORM) is True else {}
    return {
        **aux_norms,
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.o_proj.weight": ((h, q), None),
        "midlayer.mlp.gate_proj.weight": ((i, h), None),
        "midlayer.mlp.up_proj.weight": ((i, h), None),
        "midlayer.mlp.down_proj.weight": ((h, i), None),
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        "fc.weight": ((h, 3 * ht), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((config["draft_vocab_size"], h), None),
        "d2t": ((config["draft_vocab_size"],), "I64"),
        "t2d": ((config["vocab_size"],), "BOOL"),
    }


def read_safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def read_array(path: Path, name: str, dtype: type) -> np.ndarray:
    """One tensor of a safetensors file as a numpy array, read by its header's offsets: numpy cannot hold
    the file's bf16 tensors, so ``safetensors.numpy.load_file`` would refuse the whole file."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        begin, end = json.loads(handle.read(length))[name]["data_offsets"]
        handle.seek(8 + length + begin)
        return np.frombuffer(handle.read(end - begin), dtype=dtype)


def read_config(path: Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{file}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"{file}: not valid JSON ({exc})") from None


def check_tensors(path: Path, config: dict[str, Any], *, published: bool = False,
                  expected: dict[str, tuple[tuple[int, ...], str | None]] | None = None) -> None:
    """Every required tensor present with its shape and dtype; d2t/t2d a consistent mapping.

    ``published``: a drafter not written by draftline, whose weights may be in any float dtype (its
    ``torch_dtype`` is often not theirs) and which may lack the mapping (then the trainer computes one).
    ``expected``: the table to hold the file to (``expected_tensors``'s form); EAGLE-3's by default.
    """
    weights = Path(path) / WEIGHTS_FILE
    header = read_safetensors_header(weights)
    float_dtype = None if published else FLOAT_DTYPES.get(config.get("torch_dtype", ""))
    problems = []
    for name, (shape, dtype) in (expected or expected_tensors(config)).items():
        if name not in header:
            if not (published and name in MAPPING_TENSORS):
                problems.append(f"{name} missing")
            continue
        found_shape, found_dtype = tuple(header[name]["shape"]), header[name]["dtype"]
        want_dtype = dtype or float_dtype
        if found_shape != shape:
            problems.append(f"{name} has shape {list(found_shape)}, expected {list(shape)}")
        if (want_dtype is None and found_dtype not in FLOAT_DTYPES.values()) or (want_dtype and found_dtype != want_dtype):
            problems.append(f"{name} has dtype {found_dtype}, expected {want_dtype or 'a float dtype'}")
    if problems:
        raise CheckpointFormatError(f"{weights}: " + "; ".join(problems))
    mapping = read_mapping(path, config["vocab_size"])
    if mapping is None:
        return
    try:
        check_mapping(*mapping)
    except ValueError as exc:
        raise CheckpointFormatError(f"{weights}: {exc}") from None


def mapping_tensors(path: Path) -> list[str]:
    """Which of ``d2t`` and ``t2d`` the checkpoint's weights hold."""
    header = read_safetensors_header(Path(path) / WEIGHTS_FILE)
    return [name for name in MAPPING_TENSORS if name in header]


def read_mapping(path: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(d2t, t2d)`` of a checkpoint, a missing half derived from the other (draft ids follow ascending
    target ids, as every EAGLE-3 trainer builds them); None when it holds neither."""
    weights, present = Path(path) / WEIGHTS_FILE, mapping_tensors(path)
    if not present:
        return None
    d2t = read_array(weights, "d2t", np.int64) if "d2t" in present else None
    t2d = read_array(weights, "t2d", np.bool_) if "t2d" in present else None
    if t2d is None:
        targets = np.arange(d2t.shape[0], dtype=np.int64) + d2t
        if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
            raise CheckpointFormatError(f"{weights}: d2t maps outside the target vocabulary of {vocab_size}")
        t2d = np.zeros(vocab_size, dtype=bool)
        t2d[targets] = True
    if d2t is None:
        targets = np.flatnonzero(t2d).astype(np.int64)
        d2t = targets - np.arange(targets.size, dtype=np.int64)
    return d2t, t2d


def has_type(value: Any, expected: type | tuple[type, ...]) -> bool:
    """isinstance, except that JSON true/false is no number and a number no boolean."""
    return isinstance(value, expected) and isinstance(value, bool) == (expected is bool)


def check_config(path: Path, config: dict[str, Any]) -> None:
    """The fields the engines and draftline read, with the types and values they need."""
    problems = [f"{key} missing" for key in CONFIG_TYPES if key not in config]
    problems += [f"{key} is {type(config[key]).__name__}, expected {expected}"
                 for key, expected in CONFIG_TYPES.items() if key in config and not has_type(config[key], expected)]
    if problems:
        raise CheckpointFormatError(f"{path / CONFIG_FILE}: " + "; ".join(problems))
    ids = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    rules = [
        (config["architectures"] == [ARCHITECTURE], f"architectures must be [{ARCHITECTURE!r}]"),
        (config["model_type"] == "llama", "model_type must be 'llama'"),
        (config["num_hidden_layers"] == 1, "num_hidden_layers must be 1"),
        (config["tie_word_embeddings"] is False, "tie_word_embeddings must be false"),
        (config.get("norm_before_residual", False) is False, "norm_before_residual must be false (the drafter's residual is un-normed)"),
        (config["draft_vocab_size"] <= config["vocab_size"], "draft_vocab_size exceeds vocab_size"),
        (config["eagle_config"].get("use_aux_hidden_state") is True, "eagle_config.use_aux_hidden_state must be true"),
        (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) for i in ids), "eagle_config needs three layer ids"),
        (config["draftline"].get("layer_convention") == eagle3.LAYER_CONVENTION,
         f"draftline.layer_convention must be {eagle3.LAYER_CONVENTION!r}"),
        (config["draftline"].get("layer_ids") == ids, "draftline.layer_ids differ from eagle_config's"),
        (isinstance(ids, list) and config.get("eagle_aux_hidden_state_layer_ids") == vllm_layer_ids(ids),
         "top-level eagle_aux_hidden_state_layer_ids must be eagle_config's plus one (vLLM counts layer inputs)"),
    ]
    problems = [message for ok, message in rules if not ok]
    if problems:
        raise CheckpointFormatError(f"{path / CONFIG_FILE}: " + "; ".join(problems))


def with_engine_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A drafter config with the fields a published one may omit filled in as the engines fill them."""
    heads = config["num_attention_heads"]
    return {**config, "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "num_key_value_heads": config.get("num_key_value_heads") or heads,
            "draft_vocab_size": config.get("draft_vocab_size") or config["vocab_size"]}


def unserved_norms(config: dict[str, Any]) -> list[str]:
    """The norm switches a drafter config turns on that the drafter does not compute, each with what it does;
    ``norm_before_fc`` where either engine reads it (``eagle_config`` first, then the top level). An ``fc_norm``
    that is no boolean too: the engines take any truthy value as on, the drafter only ``true``."""
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    switched = {key: eagle_config.get(key, config.get(key)) if key == "norm_before_fc" else config.get(key)
                for key in UNSERVED_NORMS}
    found = [f"{key} is set ({UNSERVED_NORMS[key]})" for key, value in switched.items() if value]
    if not isinstance(config.get(FC_NORM, False), bool):
        found.append(f"{FC_NORM} is {config[FC_NORM]!r}, not true or false")
    return found


def check_norms(path: Path, config: dict[str, Any]) -> None:
    """CheckpointFormatError naming each norm switch an engine would apply and the drafter would not."""
    found = unserved_norms(config)
    if found:
        raise CheckpointFormatError(f"{Path(path) / CONFIG_FILE}: " + "; ".join(found) + ": an engine would serve "
                                    "another drafter than the one draftline trains and evaluates (of the norm "
                                    f"switches it computes only {FC_NORM}, true or false)")


def check_drafter(path: Path, config: dict[str, Any]) -> None:
    """Our own exports in full; a published EAGLE-3 drafter (no ``draftline`` block) by the tensors the
    trainer loads, with their shapes, taking the engines' defaults for the head fields it may omit. Either
    is refused where it sets a norm switch the drafter does not compute (``check_norms``)."""
    path = Path(path)
    published = "draftline" not in config
    check_norms(path, config)
    if not published:
        check_config(path, config)
    try:
        filled = with_engine_defaults(config)
        expected_tensors(filled)  # every field the shapes need is there
    except (KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{path / CONFIG_FILE}: {exc} missing or not a number") from None
    if published:
        layer_ids_of(config, None, path=path)  # the two engine fields, if both are there, must agree
    check_tensors(path, filled, published=published)


def verify_export(path: Path) -> dict[str, Any]:
    """Raise CheckpointFormatError unless ``path`` holds a complete draftline export; return its config."""
    path = Path(path)
    config = read_config(path)
    check_config(path, config)
    check_norms(path, config)
    check_tensors(path, config)
    return config


def check_mapping(d2t: np.ndarray, t2d: np.ndarray) -> None:
    """Raise ValueError unless ``d2t`` names distinct in-range target ids and ``t2d`` marks exactly them."""
    targets = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    vocab = t2d.shape[0]
    if targets.size and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"d2t maps outside the target vocabulary of {vocab}")
    if np.unique(targets).size != targets.size:
        raise ValueError("d2t maps two draft ids to the same target id")
    expected = np.zeros(vocab, dtype=bool)
    expected[targets] = True
    if not np.array_equal(expected, t2d.astype(bool)):
        raise ValueError("t2d does not mark exactly the target ids that d2t names")


def layer_ids_source(config: dict[str, Any], path: Path | None = None) -> tuple[str, list[int] | None]:
    """Which field a drafter config's layer ids come from and our ids in it (None: no field names any).
    The one place that maps vLLM's ids to ours."""
    where = f"{path / CONFIG_FILE}: " if path is not None else ""
    if "draftline" in config:
        return "draftline.layer_ids", list(config["draftline"]["layer_ids"])
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = config.get(VLLM_IDS)
    for field, ids in ((SGLANG_IDS, sglang), (VLLM_IDS, vllm)):
        if ids is not None and not (isinstance(ids, list) and all(has_type(i, int) for i in ids)):
            raise CheckpointFormatError(f"{where}{field} is {ids!r}, expected a list of layer ids")
    if sglang and vllm and vllm != vllm_layer_ids(sglang):
        raise CheckpointFormatError(f"{where}{VLLM_IDS} is {vllm} and {SGLANG_IDS} is {sglang}: vLLM reads the "
                                    "first and SGLang the second, so the two engines would read different layers "
                                    "(vLLM's ids count layer inputs: they must be SGLang's plus one)")
    if sglang:
        return SGLANG_IDS, list(sglang)
    if vllm:
        return VLLM_IDS, [i - 1 for i in vllm]
    return "default", None


def layer_ids_of(config: dict[str, Any], target_layers: int | None, *, path: Path | None = None) -> list[int]:
    """Our ids from a drafter config: draftline's record, else SGLang's field (same convention), else
    vLLM's top-level field (one higher), else the default for the target ([] when its layers are unknown)."""
    _, ids = layer_ids_source(config, path)
    if ids is not None:
        return ids
    return eagle3.default_layer_ids(target_layers) if target_layers is not None else []


# ---- a base checkpoint against the target it is fine-tuned for ------------------------------------

@dataclass(frozen=True)
class TargetFacts:
    """What a base checkpoint must agree with; None where the caller does not know (it is then not compared)."""

    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None
    fingerprint: str | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], fingerprint: str | None = None) -> TargetFacts:
        """From the target's ``config.json`` (a multimodal target's language model under ``text_config``)."""
        text = config.get("text_config") or config
        number = lambda key: text[key] if has_type(text.get(key), int) else None  # noqa: E731
        return cls(number("hidden_size"), number("vocab_size"), number("num_hidden_layers"), fingerprint)


def check_base_fits(path: Path, config: dict[str, Any], target: TargetFacts) -> list[int]:
    """Our layer ids of the base checkpoint at ``path``; BaseCheckpointMismatch naming every field that
    does not fit the target, with both values: hidden size, vocabulary, layer ids in range, and for a
    draftline export the target fingerprint it recorded."""
    hidden_field = "target_hidden_size" if config.get("target_hidden_size") else "hidden_size"
    field, ids = layer_ids_source(config, Path(path))
    problems = []
    if target.hidden_size is not None and config.get(hidden_field) != target.hidden_size:
        problems.append(f"{hidden_field} is {config.get(hidden_field)}, the target's hidden_size is {target.hidden_size}")
    if target.vocab_size is not None and config.get("vocab_size") != target.vocab_size:
        problems.append(f"vocab_size is {config.get('vocab_size')}, the target's vocab_size is {target.vocab_size}")
    if target.num_layers is not None and ids is not None:
        outside = [i for i in ids if not 0 <= i < target.num_layers]
        if len(ids) != 3 or outside:
            shown = config[VLLM_IDS] if field == VLLM_IDS else ids
            ours = f" (layer outputs {ids})" if field == VLLM_IDS else ""
            problems.append(f"{field} is {shown}{ours}, the target has num_hidden_layers {target.num_layers} "
                            f"(three layer outputs in 0..{target.num_layers - 1})")
    recorded = (config.get("draftline") or {}).get("target_fingerprint")
    if target.fingerprint and recorded and recorded != target.fingerprint:
        problems.append(f"draftline.target_fingerprint is {recorded}, the target's fingerprint is {target.fingerprint}")
    if problems:
        raise BaseCheckpointMismatch(f"base checkpoint {path} does not fit the target: " + "; ".join(problems))
    if ids is None:
        return eagle3.default_layer_ids(target.num_layers) if target.num_layers is not None else []
    return ids
