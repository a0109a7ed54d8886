"""Load the target once: model, tokenizer, and the facts every route reports about it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shared.chat_turns import eos_candidates, find_turn_end
from shared.fingerprint import model_fingerprint
from shared import eagle3
from runtime.remote_code import load_from_target
from shared.settings import InferenceSettings
from modeling.attention import avoid_cudnn_attention

log = logging.getLogger(__name__)

__all__ = ["LoadedModel", "load_model", "model_fingerprint", "resolve_device", "resolve_dtype", "safetensors_dtype"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
THINK_CLOSE = "</think>"


@dataclass
class LoadedModel:
    """The target in evaluation mode plus what the routes need to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    pad_token_id: int
    context_length: int
    knows_think_close: bool

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def dtype_name(self) -> str:
        """The safetensors dtype string (``"BF16"``, ``"F32"``) of the hidden states this target writes."""
        return safetensors_dtype(self.dtype)

    def default_layer_ids(self) -> list[int]:
        return eagle3.default_layer_ids(self.num_layers)


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """bf16 on CUDA and fp32 on CPU unless the settings name one (CPU bf16 matmuls are slow and lossy)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[setting]


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return _SAFETENSORS_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"hidden states in {dtype} are not supported; use bfloat16, float16 or float32") from None


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a reply: generation_config's (an int or a list), the tokenizer's eos, and the
    end-of-turn token the chat template closes an assistant turn with. The last matters where it differs
    from eos (ChatML's ``<|im_end|>`` beside ``<|endoftext|>``): a chat reply ends there, and decoding on
    would write the next turn."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos_candidates(tokenizer, configured))
    turn_end = find_turn_end(tokenizer, eos_ids=configured)
    if turn_end.token_id is not None:
        ids.add(turn_end.token_id)
    if not ids:
        raise ValueError("the target defines no end-of-sequence token (generation_config or tokenizer)")
    log.info("target stops on %s (end of turn %r, from %s)", sorted(ids), turn_end.token(tokenizer), turn_end.source)
    return frozenset(ids)


def context_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    configured = getattr(model.config, "max_position_embeddings", None)
    if configured:
        return int(configured)
    # Tokenizers without a limit report a huge sentinel; it still bounds the prompt check sensibly.
    return int(tokenizer.model_max_length)


def load_model(settings: InferenceSettings) -> LoadedModel:
    """Load ``settings.model_dir`` with the real ``from_pretrained`` onto the chosen device and dtype."""
    model_dir = Path(settings.model_dir)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cuda":
        avoid_cudnn_attention()
    log.info("loading target %s on %s in %s", model_dir, device, dtype)
    trust = settings.trust_remote_code
    tokenizer = load_from_target(AutoTokenizer.from_pretrained, model_dir, trust_remote_code=trust)
    model = load_from_target(AutoModelForCausalLM.from_pretrained, model_dir, trust_remote_code=trust,
                             dtype=dtype).to(device).eval()
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=settings.model_name or model_dir.resolve().name,
        fingerprint=model_fingerprint(model_dir),
        device=device,
        dtype=dtype,
        eos_token_ids=eos,
        pad_token_id=int(pad),
        context_length=context_length(model, tokenizer),
        knows_think_close=THINK_CLOSE in tokenizer.get_vocab(),
    )
    log.info("target %s ready: %d layers, hidden %d, fingerprint %s", loaded.name, loaded.num_layers,
             loaded.hidden_size, loaded.fingerprint[:12])
    return loaded
