"""Where an extract job's hidden states come from (``DRAFTLINE_HIDDEN_SOURCE``), behind one interface.

- ``builtin``: the built-in inference server runs the target and writes the file itself (``client.py``).
- ``vllm``: a vLLM server saves the states with its ``extract_hidden_states`` method; the extractor turns
  its file into draftline's (``vllm_source.py``). For targets no single process holds.

Either way the job verifies the file, records it in the manifest and settles the sample the same way:
the files on the volume, resume and every failure path do not depend on the source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from services.extractor.client import HiddenStatesClient, HiddenStatesResult
from shared.errors import DraftlineError
from runtime.retry import RetryPolicy
from shared.settings import ExtractorSettings


class HiddenStateSource(Protocol):
    @property
    def endpoints(self) -> list[str]: ...

    def extract(self, *, input_ids: list[int], loss_mask: list[int], path: str, layer_ids: list[int] | None,
                metadata: dict[str, str], storage: str = "target",
                on_retry: Callable[[], object] | None = None) -> HiddenStatesResult:
        """Write the sample's file at ``path`` (inside the data volume), its states stored as ``storage``
        says (the run's ``extraction.storage``), and describe it."""

    def close(self) -> None:
        """End the connections the source keeps between requests (a job calls it as it ends)."""


class SourceMisconfigured(DraftlineError):
    """The chosen hidden-state source lacks a setting it needs."""


def make_source(settings: ExtractorSettings, *, model: str, start: int | None = None) -> HiddenStateSource:
    """The configured source; ``model`` is the run's served model name, ``start`` the first endpoint's index."""
    policy = RetryPolicy.from_settings(settings)
    if settings.hidden_source == "builtin":
        return HiddenStatesClient(settings.hidden_states_url, timeout_s=settings.request_timeout_s, policy=policy,
                                  start=start)
    from services.extractor.vllm_source import VllmHiddenStates  # torch: only where the engine's files are read

    if settings.vllm_storage is None:
        raise SourceMisconfigured("DRAFTLINE_HIDDEN_SOURCE=vllm needs DRAFTLINE_VLLM_STORAGE: the directory the "
                                  "vLLM connector writes to (its shared_storage_path), as the extractor sees it")
    return VllmHiddenStates(settings.hidden_states_url, model=model, model_dir=settings.model_dir, data=settings.data,
                            storage=settings.vllm_storage, saved_layers=settings.vllm_saved_layers,
                            timeout_s=settings.request_timeout_s, policy=policy, start=start)
