"""The hidden-state pipeline: forward passes on one thread, file writes on a pool, overlapping.

    submit() ─▶ queue ─▶ forward thread: take what is queued (a window), sort it by length, cut it
                         into groups of up to ``batch_tokens`` (padded), forward each under
                         inference_mode, turn the states into what the files store (fp8 quantized
                         there, on the device), copy each row to host (CUDA: pinned buffers,
                         non_blocking, then a recorded event)
                      ─▶ writer pool: wait for the event, write header and tensor memory atomically, resolve the future

While the writers write one group, the forward thread already computes the next. A
semaphore bounds the groups waiting for their writers, so slow storage stalls the GPU instead of
filling host memory.

Requests come from many extractors at once in no particular order of length. Grouped as they arrive, a
group pads every row to its longest: on an 8B target with samples of 512-4,096 tokens only 58% of the
computed positions were real (the performance issue's measurement). Sorted first, a group's rows are of
similar length. A window is served whole before the next one is taken, so a short request waits for at
most the window it arrived in, never for long requests that arrive after it.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.inference.hidden import HiddenJob, WrittenSample, forward_hidden, stored_states, write_stored
from services.inference.model import LoadedModel
from runtime.disk import format_bytes, volume_usage
from shared.errors import DraftlineError

log = logging.getLogger(__name__)

_STOP = object()
Item = tuple[HiddenJob, Future]
WINDOW_ITEMS = 512  # requests sorted together at most: enough for every extractor's in-flight requests
# A quota counts as a full disk too: either way the volume has no room for this file right now.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class VolumeFull(DraftlineError):
    """The data volume had no room for a hidden-state file; its temp file is removed, nothing is published."""

    permanent = False

    def __init__(self, job: HiddenJob, cause: OSError) -> None:
        self.volume = volume_of(job)
        self.free_bytes, _ = volume_usage(self.volume)
        super().__init__(
            f"no space left on the data volume {self.volume} ({self.free_bytes} bytes free, "
            f"{format_bytes(self.free_bytes)}) while writing {job.relative_path} "
            f"({job.num_tokens} tokens): {cause.strerror or cause}; nothing was written"
        )


def volume_of(job: HiddenJob) -> Path:
    """The volume root: the job's absolute path less its volume-relative part."""
    path = Path(job.path)
    for _ in Path(job.relative_path).parts:
        path = path.parent
    return path


class PinnedBuffers:
    """Reusable page-locked host memory. Device-to-host copies into it run asynchronously, and reuse
    avoids a slow page-locked allocation per group."""

    def __init__(self, keep: int, *, pin: bool = True) -> None:
        self._keep = keep
        self._pin = pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat, view)``: a flat uint8 buffer to give back later and a (shape, dtype) view into it."""
        nbytes = max(1, torch.Size(shape).numel() * dtype.itemsize)
        with self._lock:
            fits = [i for i, buf in enumerate(self._free) if buf.numel() >= nbytes]
            best = min(fits, key=lambda i: self._free[i].numel()) if fits else None
            flat = self._free.pop(best) if best is not None else None
        if flat is None:
            # Powers of two let groups of slightly different sizes reuse the same buffer.
            flat = torch.empty(1 << (nbytes - 1).bit_length(), dtype=torch.uint8, pin_memory=self._pin)
        return flat, flat[:nbytes].view(dtype).view(shape)

    def give(self, flat: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(flat)


@dataclass
class HostGroup:
    """One group's per-row states on the host, waiting for the writers."""

    items: list[Item]
    rows: list[dict[str, torch.Tensor]]  # per row, its file's state tensors (stored_states), (L_i, ·) each
    ready: torch.cuda.Event | None  # recorded after the copies; None when the states already live on the host
    on_done: Callable[[], None]
    _remaining: int = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self._remaining = len(self.items)

    def row_done(self) -> None:
        with self._lock:
            self._remaining -= 1
            finished = self._remaining == 0
        if finished:
            self.on_done()


class HiddenStatePipeline:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        batch_tokens: int,
        writer_threads: int,
        max_pending_groups: int | None = None,
        on_batch: Callable[[int], None] | None = None,
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self._batch_tokens = batch_tokens
        self._on_batch = on_batch
        self._on_written = on_written
        pending = max_pending_groups or writer_threads + 1
        self._slots = threading.Semaphore(pending)
        self._pinned = PinnedBuffers(keep=2 * pending) if loaded.device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue()
        self._window: list[Item] = []  # taken from the queue, sorted longest first, not yet grouped
        self._stop_seen = False
        self._writers = ThreadPoolExecutor(writer_threads, thread_name_prefix="hidden-writer")
        self._thread = threading.Thread(target=self._loop, name="hidden-forward", daemon=True)

    def start(self) -> HiddenStatePipeline:
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Process everything queued, wait for the writes, then end the threads."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._writers.shutdown(wait=True)

    def submit(self, job: HiddenJob) -> Future[WrittenSample]:
        future: Future[WrittenSample] = Future()
        self._queue.put((job, future))
        return future

    # -- forward thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            group, stopping = self._collect()
            live = [(job, fut) for job, fut in group if fut.set_running_or_notify_cancel()]
            if live:
                self._process(live)

    def _collect(self) -> tuple[list[Item], bool]:
        """The next group: the longest request of the window, then the next ones while the padded group
        (rows x the first, longest, row) fits the budget; a new window when this one is used up."""
        if not self._window and not self._stop_seen:
            self._take_window()
        if not self._window:
            return [], True
        group, width = [self._window[0]], self._window[0][0].num_tokens
        while len(group) < len(self._window) and width * (len(group) + 1) <= self._batch_tokens:
            group.append(self._window[len(group)])
        del self._window[: len(group)]
        return group, self._stop_seen and not self._window

    def _take_window(self) -> None:
        """Block for one request, then take whatever else is queued (up to WINDOW_ITEMS), longest first;
        equal lengths keep their order of arrival."""
        taken: list[Item] = []
        item = self._queue.get()
        while item is not _STOP:
            taken.append(item)
            if len(taken) >= WINDOW_ITEMS:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        else:
            self._stop_seen = True
        self._window = sorted(taken, key=lambda it: -it[0].num_tokens)

    def _process(self, group: list[Item]) -> None:
        self._slots.acquire()
        try:
            host = self._to_host(group)
        except torch.OutOfMemoryError:
            self._slots.release()
            if len(group) == 1:
                self._fail(group, MemoryError("out of device memory for a single sample"))
                return
            # Smaller groups may fit: retry each half instead of failing every request.
            log.warning("out of memory on a group of %d; splitting it", len(group))
            torch.cuda.empty_cache()
            half = len(group) // 2
            self._process(group[:half])
            self._process(group[half:])
            return
        except Exception as exc:
            self._slots.release()
            log.exception("hidden-state forward of %d samples failed", len(group))
            self._fail(group, exc)
            return
        if self._on_batch is not None:
            self._on_batch(len(group))
        for row in range(len(group)):
            self._writers.submit(self._write, host, row)

    def _to_host(self, group: list[Item]) -> HostGroup:
        jobs = [job for job, _ in group]
        with torch.inference_mode():
            aux, last = forward_hidden(self.loaded, jobs)  # (B, T, 3H), (B, T, H)
            # Once per storage the group's runs ask for (one, nearly always), over the whole padded batch.
            stored = {storage: stored_states(aux, last, storage) for storage in dict.fromkeys(j.storage for j in jobs)}
            if self._pinned is None:
                rows = [{name: t[i, : j.num_tokens] for name, t in stored[j.storage].items()} for i, j in enumerate(jobs)]
                return HostGroup(group, rows, None, self._slots.release)
            return self._copy_to_pinned(group, stored)

    def _copy_to_pinned(self, group: list[Item], stored: dict[str, dict[str, torch.Tensor]]) -> HostGroup:
        """Pack the rows without their padding into pinned buffers, one per stored tensor, asynchronously."""
        jobs = [job for job, _ in group]
        totals: dict[tuple[str, str], int] = {}
        for job in jobs:
            for name in stored[job.storage]:
                totals[job.storage, name] = totals.get((job.storage, name), 0) + job.num_tokens
        buffers = {key: self._pinned.take((total, stored[key[0]][key[1]].shape[-1]), stored[key[0]][key[1]].dtype)
                   for key, total in totals.items()}  # key -> (flat, (ΣL, width) view)
        offsets = dict.fromkeys(buffers, 0)
        rows = []
        for row, job in enumerate(jobs):
            one = {}
            for name, states in stored[job.storage].items():
                key, length = (job.storage, name), job.num_tokens
                host = buffers[key][1][offsets[key]: offsets[key] + length]
                host.copy_(states[row, :length], non_blocking=True)
                offsets[key] += length
                one[name] = host
            rows.append(one)
        ready = torch.cuda.Event()
        ready.record()  # the device tensors stay valid: later kernels on this stream run after the copies

        def release() -> None:
            for flat, _ in buffers.values():
                self._pinned.give(flat)
            self._slots.release()

        return HostGroup(group, rows, ready, release)

    @staticmethod
    def _fail(group: list[Item], exc: BaseException) -> None:
        for _, fut in group:
            fut.set_exception(exc)

    # -- writer threads ------------------------------------------------------------------------

    def _write(self, host: HostGroup, row: int) -> None:
        job, fut = host.items[row]
        try:
            if host.ready is not None:
                host.ready.synchronize()
            written = write_stored(self.loaded, job, host.rows[row])
            if self._on_written is not None:
                self._on_written(written.bytes)
            fut.set_result(written)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                exc = VolumeFull(job, exc)  # atomic_write already removed the temp file
                log.warning("%s", exc)
            else:
                log.exception("writing %s failed", job.path)
            fut.set_exception(exc)
        finally:
            host.row_done()
