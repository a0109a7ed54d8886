"""Hidden states from a vLLM server: a prefill-only request over the sample's token ids, the engine's file
turned into draftline's verified format.

vLLM saves states itself when it runs the speculative method ``extract_hidden_states`` with a KV
connector (``services/extractor/vllm_connector.py`` on CPU hosts, the stock one on GPUs): every request's
states of the layers named in ``eagle_aux_hidden_state_layer_ids`` go to ``<storage>/<request>.safetensors``
(``hidden_states`` [T, layers, H] in ascending layer order, ``token_ids`` [T]) and the response names the
path in ``kv_transfer_params.hidden_states_path``. A completions request whose prompt is the token ids
themselves and which asks for one token covers every token of the sample and re-tokenizes nothing.

Here: send that request (retries and fail-over as every client, ``runtime.dispatch``), wait for the
engine's writer (it holds ``<path>.lock`` exclusively until the file is complete), check the ids are
the ones sent, take the auxiliary layers and apply the target's final norm to the last layer (vLLM
saves it before the norm; draftline files hold the input of ``lm_head``), write the sample atomically
with the same tensors and metadata the built-in server writes (fp8 with scales when the run stores
fp8), and delete the engine's file and lock whatever happened. Layer ids map between the two
conventions only through ``shared.eagle3``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors import safe_open

from services.extractor.client import HiddenStatesResult, MalformedHiddenResponse
from shared import SCHEMA_VERSION, eagle3
from runtime.dispatch import Dispatcher, http_timeout
from shared.errors import CheckpointFormatError, DraftlineError
from shared.fingerprint import model_fingerprint
from shared.hidden_write import RawTensor, write_safetensors
from runtime.retry import Failed, RetryPolicy, post_json, server_root, tls_context
from modeling.fp8 import quantize_fp8

log = logging.getLogger(__name__)

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
# Final norms that are ``weight * x / rms(x)``; another kind would need its own formula, so it is refused.
RMS_NORM_TARGETS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2"})
INDEX_FILE = "model.safetensors.index.json"
# The final norm's name in a causal LM and in multimodal wrappers, checked in order; other wrappers are
# found by the suffix, which a decoder layer's norms (``…layers.N.input_layernorm.weight``,
# ``…post_attention_layernorm.weight``) and an MTP layer's (``…shared_head.norm.weight``) never end in.
NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")
NORM_SUFFIX = "model.norm.weight"


class EngineLayersMissing(DraftlineError):
    """The vLLM server does not save a layer the sample needs: it was started with other layer ids."""


class EngineFileError(DraftlineError):
    """The engine's hidden-state file is missing, unreadable, or not for the tokens that were sent."""


class EngineFileLost(EngineFileError):
    """The engine answered, then its writer let go of the file's lock without a whole file there: the engine
    died between its answer and the end of its write (its files are written after the answer is sent)."""


class FinalNormNotFound(CheckpointFormatError):
    """The target's checkpoint names no final norm weight, or several tensors that could be it."""


def checkpoint_tensors(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (``model.safetensors.index.json``, else every file)."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise FinalNormNotFound(f"target {root.name}: {INDEX_FILE} has no weight_map")
        return {name: root / file for name, file in weight_map.items()}
    names: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def final_norm_name(names: Iterable[str], target: str) -> str:
    """The final norm's tensor: a known name, else the one name ending in ``NORM_SUFFIX``."""
    names = set(names)
    for name in NORM_NAMES:
        if name in names:
            return name
    matches = sorted(name for name in names if name.endswith(NORM_SUFFIX))
    if len(matches) != 1:
        found = f"several end in {NORM_SUFFIX!r}: {matches[:4]}" if matches else f"none ends in {NORM_SUFFIX!r}"
        raise FinalNormNotFound(f"target {target}: no tensor is named {' or '.join(NORM_NAMES)}, and {found}")
    return matches[0]


@lru_cache(maxsize=2)
def final_norm(model_dir: str) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm: its weight (from the checkpoint) and epsilon (from the config)."""
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    text = config.get("text_config") or config
    if text.get("model_type") not in RMS_NORM_TARGETS:
        raise EngineFileError(f"target {root.name}: model_type {text.get('model_type')!r} has no known final norm "
                              f"(supported: {sorted(RMS_NORM_TARGETS)})")
    tensors = checkpoint_tensors(root)
    name = final_norm_name(tensors, root.name)
    with safe_open(str(tensors[name]), framework="pt") as f:
        return f.get_tensor(name).float(), float(text.get("rms_norm_eps", 1e-6))


def apply_norm(state: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in float32, cast back, scale (what the target's own forward computes)."""
    x = state.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(state.dtype)
    return (weight.to(state.dtype) * normed).contiguous()


class VllmHiddenStates:
    """A ``HiddenStateSource`` over one vLLM server or several (``base_url`` comma-separated)."""

    def __init__(self, base_url: str, *, model: str, model_dir: Path, data: Path, storage: Path,
                 saved_layers: list[int] | None, timeout_s: float, policy: RetryPolicy | None = None,
                 start: int | None = None) -> None:
        self.model, self.model_dir, self.data = model, Path(model_dir), Path(data)
        self.storage = Path(storage).resolve()
        config = json.loads((self.model_dir / "config.json").read_text())
        self.num_layers = int((config.get("text_config") or config)["num_hidden_layers"])
        self.fingerprint = model_fingerprint(self.model_dir)  # once per source, not per sample
        self.saved_layers = sorted(saved_layers) if saved_layers else None
        self.timeout = http_timeout(timeout_s)
        self.policy = policy or RetryPolicy()
        self._dispatch = Dispatcher(base_url, self.policy, "vLLM hidden-state request", start=start)
        self._http = httpx.Client(timeout=self.timeout, verify=tls_context())  # kept alive over a job's samples

    def close(self) -> None:
        self._http.close()

    @property
    def endpoints(self) -> list[str]:
        return self._dispatch.pool.urls

    def extract(self, *, input_ids: list[int], loss_mask: list[int], path: str, layer_ids: list[int] | None,
                metadata: dict[str, str], storage: str = "target",
                on_retry: Callable[[], object] | None = None) -> HiddenStatesResult:
        layers = eagle3.check_layer_ids(list(layer_ids) if layer_ids else eagle3.default_layer_ids(self.num_layers),
                                        self.num_layers)
        saved = self.saved_layers or eagle3.engine_saved_layers(eagle3.default_layer_ids(self.num_layers), self.num_layers)
        missing = sorted(set(eagle3.engine_saved_layers(layers, self.num_layers)) - set(saved))
        if missing:
            raise EngineLayersMissing(
                f"the vLLM server saves layers {saved} (vLLM ids); this sample needs {missing} as well for draftline "
                f"layers {layers} and the last layer: start it with eagle_aux_hidden_state_layer_ids "
                f"{eagle3.engine_saved_layers(layers, self.num_layers)}")
        # save_hidden_states: what draftline's selective connector saves for (the stock one saves every request).
        body = {"model": self.model, "prompt": input_ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True, "kv_transfer_params": {"save_hidden_states": True}}
        # An engine killed after it answered leaves no whole file: the request is sent again (the server is
        # waited for as on any outage), up to the policy's attempts, before the sample fails by name.
        for sent in range(1, self.policy.max_attempts + 1):
            try:
                states = self._request(body, input_ids, len(saved), on_retry)
                break
            except EngineFileLost as exc:
                if sent == self.policy.max_attempts:
                    raise
                log.warning("%s; asking the engine again (%d of %d)", exc, sent + 1, self.policy.max_attempts)
                if on_retry is not None:
                    on_retry()
        return self._write(states, saved, layers, input_ids, loss_mask, path, metadata, storage)

    def _request(self, body: dict, input_ids: list[int], layers: int,
                 on_retry: Callable[[], object] | None) -> torch.Tensor:
        """One request through the dispatcher (its retries and fail-over), the engine's file read and deleted."""
        attempts: list[str] = []

        def attempt(root: str) -> Path | Failed:
            attempts.append(f"draftline-{uuid.uuid4().hex}")
            return self._once(root, body, attempts[-1])

        answered = False
        try:
            engine_file = self._dispatch.send(attempt, on_retry=on_retry)
            answered = True
            try:
                return self._read(engine_file, input_ids, layers)  # (T, layers, H)
            finally:
                engine_file.unlink(missing_ok=True)
                engine_file.with_name(engine_file.name + ".lock").unlink(missing_ok=True)
        finally:
            self._drop_unanswered(attempts[:-1] if answered else attempts)

    def _drop_unanswered(self, attempts: list[str]) -> None:
        """Delete what the engine wrote for attempts that got no answer. An engine killed after it scheduled a
        request leaves that request's ``.lock`` and maybe its file, named after the request id, which carries
        the attempt's ``X-Request-Id``; nobody else knows those names, so without this they stay on the volume
        forever. (An attempt given up on while a live engine still runs it can still write after this.)"""
        for tag in attempts:  # none in the usual case: one attempt, answered, its file read and deleted above
            for leftover in self.storage.glob(f"*{tag}*"):
                leftover.unlink(missing_ok=True)
                log.info("removed %s, left by a hidden-state request the engine never answered", leftover.name)

    def _once(self, root: str, body: dict, request_id: str) -> Path | Failed:
        # vLLM names the request, and so its file, after this header: what _drop_unanswered looks for.
        response = post_json(f"{server_root(root)}/v1/completions", body, self.timeout,
                             headers={"X-Request-Id": request_id}, client=self._http)
        if isinstance(response, Failed):
            return response
        try:
            named = response.json()["kv_transfer_params"]["hidden_states_path"]
        except (ValueError, KeyError, TypeError):
            raise MalformedHiddenResponse(f"vLLM's answer names no hidden_states_path (is it started with the "
                                          f"extract_hidden_states method and a connector?): {response.text[:200]}") from None
        engine_file = Path(str(named)).resolve()
        if not engine_file.is_relative_to(self.storage):  # never read, nor delete, a file outside the engine's storage
            raise MalformedHiddenResponse(f"vLLM names {engine_file}, outside its storage {self.storage}")
        return engine_file

    @staticmethod
    def _read(engine_file: Path, input_ids: list[int], layers: int) -> torch.Tensor:
        lock = engine_file.with_name(engine_file.name + ".lock")
        try:
            with open(lock, "a+b") as handle:  # the engine's writer holds it exclusively until the file is whole
                fcntl.flock(handle, fcntl.LOCK_SH)
                with safe_open(str(engine_file), framework="pt") as f:
                    states, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        except (OSError, ValueError) as exc:  # the lock is free, so its writer finished or died
            raise EngineFileLost(f"{engine_file}: no whole engine hidden-state file once its writer let go: {exc}") from None
        except KeyError as exc:
            raise EngineFileError(f"{engine_file}: engine hidden-state file without {exc}") from None
        if ids.tolist() != list(input_ids):
            raise EngineFileError(f"{engine_file}: holds {ids.numel()} tokens that are not the {len(input_ids)} sent")
        if states.dim() != 3 or states.shape[:2] != (len(input_ids), layers):
            raise EngineFileError(f"{engine_file}: hidden_states {tuple(states.shape)}, expected ({len(input_ids)}, "
                                  f"{layers}, H)")
        return states

    def _write(self, states: torch.Tensor, saved: list[int], layers: list[int], input_ids: list[int],
               loss_mask: list[int], path: str, metadata: dict[str, str], storage: str) -> HiddenStatesResult:
        dtype = _DTYPES[states.dtype]
        aux = torch.cat([states[:, saved.index(eagle3.engine_layer_id(i))] for i in layers], dim=-1)  # (T, 3H)
        weight, eps = final_norm(str(self.model_dir))
        last = apply_norm(states[:, saved.index(self.num_layers)], weight, eps)  # (T, H)
        tensors = {
            eagle3.INPUT_IDS: RawTensor.of(np.asarray(input_ids, dtype=np.int64)),
            eagle3.LOSS_MASK: RawTensor.of(np.asarray(loss_mask, dtype=np.uint8)),
            **state_tensors(eagle3.AUX_HIDDEN, aux, storage, dtype),
            **state_tensors(eagle3.LAST_HIDDEN, last, storage, dtype),
        }
        meta = {**metadata, eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE, eagle3.META_SCHEMA: str(SCHEMA_VERSION),
                eagle3.META_LAYER_IDS: json.dumps(layers), eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION,
                eagle3.META_MODEL: self.model, eagle3.META_MODEL_FINGERPRINT: self.fingerprint,
                eagle3.META_DTYPE: dtype}
        written = write_safetensors(self.data / path, tensors, meta)
        t, h = len(input_ids), last.shape[-1]
        stored = eagle3.FP8_DTYPE if storage == "fp8" else dtype
        return HiddenStatesResult(
            path=path, num_tokens=t, dtype=stored, layer_ids=layers, layer_convention=eagle3.LAYER_CONVENTION,
            shapes={eagle3.INPUT_IDS: [t], eagle3.LOSS_MASK: [t], eagle3.AUX_HIDDEN: [t, 3 * h], eagle3.LAST_HIDDEN: [t, h]},
            sha256=written.sha256, bytes=written.nbytes)


def raw(t: torch.Tensor, dtype: str) -> RawTensor:
    return RawTensor.of(t.contiguous().view(torch.uint8).numpy(), dtype=dtype, shape=tuple(t.shape))


def state_tensors(name: str, states: torch.Tensor, storage: str, dtype: str) -> dict[str, RawTensor]:
    """One state as the file stores it: as it is, or as fp8 beside its scales."""
    if storage != "fp8":
        return {name: raw(states, dtype)}
    scale_name, layers = eagle3.SCALES[name]
    quantized, scale = quantize_fp8(states, layers)
    return {name: raw(quantized, eagle3.FP8_DTYPE), scale_name: raw(scale, eagle3.SCALE_DTYPE)}
