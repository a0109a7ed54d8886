"""The training loop: each step's batch from the session's source, one optimizer step on it, the training log, the
checkpoints, and a stop at a step boundary when one is asked for.

What a step optimizes is in ``objective.py`` (EAGLE-3's training-time test; DFlash's blocks in
``modeling/dflash.py``), how the session is set up and resumed in ``session.py``, and where the batches come from
in ``sources.py`` (the stored files offline, the spool online: one interface, so this loop has no online branch).

Data order (``batching.py``): global batches of samples of similar length, each sample once per epoch, the
same on every rank and after a resume; each rank takes a strided share of every global batch.

Data parallel (DDP, several processes started by torchrun): each rank trains on its slice of every global
batch, the objective is one ``nn.Module`` call (so DDP can wrap it), and only rank 0 writes logs and
checkpoints. The loss of a step is a mean over the *global* batch's masked tokens: ranks hold different
token counts, so the mean of per-rank means would weight a short sample's tokens more than one process
does. Each rank therefore divides its token sums by the all-reduced count and scales by the world size,
which DDP's gradient average undoes; N processes then take the steps one process takes on the same
global batches, up to float32 summation order.

Checkpoints: every ``train.save_every`` steps, at the end, every ``train.save_every_s`` seconds where set, and
when a stop is asked for (``runtime.shutdown``: the worker's first SIGTERM, or torchrun's ranks' stop file). A
stop is agreed at the step's all-reduce, which carries each rank's flag, so every rank stops after the same step;
rank 0 then writes a checkpoint there and the job yields (``TrainingStopped``): the worker puts it back on its
queue, and the next trainer resumes at exactly that step.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from runtime import shutdown
from runtime.runstate import RunState
from runtime.space import SpaceHold, append_line
from services.trainer import checkpoint as ckpt
from services.trainer.batching import batch_padding, plan_padding
from services.trainer.data import Batch
from services.trainer.objective import make_targets, objective_of
from services.trainer.online_source import StopWhileWaiting
from services.trainer.session import (ProgressFn, Session, TrainProgress, TrainResult, dist_info, open_source,
                                      prepare)
from services.trainer.sources import Step
from shared.atomic import atomic_write_text
from shared.runspec import RunSpec

log = logging.getLogger(__name__)

# The train log's clock readings: the rest of a step's record is the same for two runs of one recipe and seed.
TIMING_FIELDS = ("elapsed_s", "data_s", "step_s")

__all__ = ["TrainLog", "TrainProgress", "TrainResult", "TrainingStopped", "dist_info", "train_drafter", "train_step"]


class TrainingStopped(shutdown.JobYielded):
    """Training stopped at a step boundary because a stop was asked for; a checkpoint holds that step."""


OnVolume = Callable[[str, Callable[[], object]], None]  # (what, write): a volume write that waits out a full disk


class TrainLog:
    """``train_log.jsonl``, one line per optimizer step. On resume, lines past the checkpoint go, so the
    log never shows a step twice; a fresh start empties it. A full volume makes a write wait for space
    (``on_volume``); a line is appended whole or not at all."""

    def __init__(self, path: Path, resume_step: int, enabled: bool, on_volume: OnVolume | None = None) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.on_volume = on_volume or (lambda what, write: write())
        if enabled:
            text = "".join(line + "\n" for line in self._kept(resume_step))
            self.on_volume(self.path.name, lambda: atomic_write_text(self.path, text))

    def _kept(self, step: int) -> list[str]:
        if step == 0 or not self.path.is_file():
            return []
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError):
                break  # a torn last line from a crash
        return kept

    def write(self, record: dict) -> None:
        if self.enabled:
            line = json.dumps(record, sort_keys=True)
            self.on_volume(f"{self.path.name} at step {record.get('step')}", lambda: append_line(self.path, line))


@dataclass
class Logs:
    train: TrainLog
    validation: TrainLog


@dataclass
class Meter:
    """What the loop counts across steps: the step, the tokens and time of this session, the latest held-out
    curve."""

    step: int
    started: float  # monotonic time the run's training began, counting the sessions before this one
    session_start: float
    tokens: int = 0
    validation: dict[str, float] | None = None


# ---- the loop -----------------------------------------------------------------------------------

def train_drafter(spec: RunSpec, *, data: Path, model_dir: Path, device: str = "auto", progress: ProgressFn | None = None,
                  space_hold: SpaceHold | None = None, state: RunState | None = None,
                  stop: Callable[[], bool] = shutdown.requested, trust_remote_code: bool = False) -> TrainResult:
    """Train (or resume training) the run's drafter; checkpoints as the module doc says. A write that finds the
    volume full waits for space, with ``space_hold`` naming the stage held. An online run (``online.enabled``)
    reads its states as its trainer asks for them, through the run's ``state``. ``stop`` says a stop was asked
    for: training then checkpoints at the next step boundary and raises ``TrainingStopped``."""
    s = prepare(spec, data=data, model_dir=model_dir, device=device, state=state, stop=stop,
                trust_remote_code=trust_remote_code)
    s.space_hold = space_hold
    logs = Logs(TrainLog(s.paths.train_log, s.position.step, enabled=s.rank == 0, on_volume=s.on_volume),
                TrainLog(s.paths.validation_log, s.position.step, enabled=s.validation is not None,
                         on_volume=s.on_volume))
    meter = Meter(s.position.step, time.monotonic() - s.position.elapsed_s, time.monotonic())
    open_source(s, checkpoint_now=partial(checkpoint_where_training_stands, s))
    fetching = time.monotonic()
    try:
        for epoch in range(s.position.epoch, len(s.plans)):
            padding = epoch_padding(s, epoch)
            first = s.position.batch_in_epoch if epoch == s.position.epoch else 0
            for step in s.source.batches(epoch, first):
                stopping = take_step(s, meter, logs, (epoch, padding), step, progress, time.monotonic() - fetching)
                fetching = time.monotonic()  # the source's work after this step is the next step's data time
                s.source.after_step(epoch, step.index)
                if stopping:
                    stop_here(s)
    except StopWhileWaiting:
        stop_here(s)
    s.source.finish()
    s.weights.finish()
    s.result.steps = meter.step
    return s.result


def epoch_padding(s: Session, epoch: int) -> float:
    """The share of the epoch's computed positions that are padding, logged by rank 0."""
    padding = plan_padding(s.plans[epoch], s.source.lengths, s.world)
    if s.rank == 0:
        log.info("epoch %d: %d batches, %d real of %d computed tokens (padding %.1f%%)",
                 epoch, len(s.plans[epoch]), padding.real, padding.computed, 100 * padding.fraction)
    return padding.fraction


def take_step(s: Session, meter: Meter, logs: Logs, epoch_of: tuple[int, float], step: Step,
              progress: ProgressFn | None, data_s: float = 0.0) -> bool:
    """Train one step, log it, report it and checkpoint where due; whether a stop was asked for on any rank.
    ``epoch_of``: the epoch and its padding; ``data_s``: the seconds the loop spent on the source since the last
    step (its release of that step's files, the wait for this batch and its reading), logged beside the step's
    own ``step_s`` (the copy to the device and the step, to its figures on the host): the step waits on the GPU
    at its end, so the two split the loop's time between the data and the device."""
    epoch, padding = epoch_of
    started = time.monotonic()
    batch = step.batch.to(s.device, None if s.device.type == "cuda" else torch.float32)
    done = train_step(s, batch, row_seeds(s, step.rows))
    step_s = time.monotonic() - started
    meter.step += 1
    meter.tokens += done.tokens
    step_padding = batch_padding(step.global_batch, s.source.lengths, s.world).fraction
    speed = meter.tokens / max(time.monotonic() - meter.session_start, 1e-9)
    s.result.last = TrainProgress(meter.step, s.total, epoch, done.loss, done.acc, s.scheduler.get_last_lr()[0], speed,
                                  padding, meter.validation)
    logs.train.write({"step": meter.step, "epoch": epoch, "loss": done.loss, "loss_k": done.loss_k, "acc": done.acc,
                      "grad_norm": done.grad_norm, "lr": s.result.last.lr, "padding": round(step_padding, 6),
                      "elapsed_s": round(time.monotonic() - meter.started, 3),
                      "data_s": round(data_s, 4), "step_s": round(step_s, 4),
                      # each epoch's multiset of samples, on the volume; tokens: what the run learned
                      "samples": [s.source.sample_ids[i] for i in step.global_batch], "tokens": done.tokens})
    following = (epoch, step.index + 1) if step.index + 1 < len(s.plans[epoch]) else (epoch + 1, 0)
    s.trained_to = ckpt.Position(meter.step, *following, round(time.monotonic() - meter.started, 3))
    scheduled = meter.step % s.cfg.save_every == 0 or meter.step == s.total
    timed = s.cfg.save_every_s is not None and time.monotonic() - s.saved_at >= s.cfg.save_every_s
    if s.rank == 0 and scheduled and s.validation is not None:
        meter.validation = measure_held_out(s, meter.step, epoch, logs.validation)  # None: no current figure
        s.result.last = replace(s.result.last, validation=meter.validation)
    if progress is not None and s.rank == 0:
        progress(s.result.last)
    if s.rank == 0 and (scheduled or timed):
        save_checkpoint(s, s.trained_to, "" if scheduled else f" (train.save_every_s {s.cfg.save_every_s:g})")
    return done.stop


def stop_here(s: Session) -> None:
    """Training stops where it stands: rank 0 writes a checkpoint there (unless one holds it already)."""
    checkpoint_where_training_stands(s)
    raise TrainingStopped(f"run {s.paths.run}: training stopped at step {s.trained_to.step} of {s.total} on request; "
                          "its checkpoint holds that step, and the run resumes there")


def checkpoint_where_training_stands(s: Session) -> None:
    if s.rank == 0 and s.trained_to.step > 0 and s.saved_step != s.trained_to.step:
        save_checkpoint(s, s.trained_to, " (a stop was asked for)")


def save_checkpoint(s: Session, position: ckpt.Position, why: str = "") -> None:
    """Rank 0's checkpoint at ``position``."""
    with s.weights.full_precision():
        s.on_volume(f"checkpoint step {position.step}", partial(
            ckpt.save_checkpoint, s.paths.checkpoint(position.step), drafter=s.drafter, optimizer=s.optimizer,
            scheduler=s.scheduler, position=position,
            extra={"total_steps": s.total, "world_size": s.world, "batching": s.source.batching,
                   "global_batch_size": s.cfg.global_batch_size, **s.source.checkpoint_extra()}))
    s.saved_at, s.saved_step = time.monotonic(), position.step
    s.source.after_checkpoint(position)
    log.info("run %s: step %d: checkpoint%s", s.paths.run, position.step, why)


def measure_held_out(s: Session, step: int, epoch: int, validation_log: TrainLog) -> dict[str, float] | None:
    """The held-out curve at this checkpoint, logged; None where measuring failed. A failure is logged with its
    error (and written to validation.jsonl) and training goes on: the measurement watches the run, and a fault in
    it must not cost the days of training it watches."""
    assert s.validation is not None
    try:
        with s.weights.full_precision():
            measured = s.validation.measure(s.drafter)
    except Exception as exc:  # noqa: BLE001 - any fault of the monitor is reported, never fatal to training
        log.exception("step %d: held-out acceptance not measured", step)
        validation_log.write({"step": step, "epoch": epoch, "error": f"{type(exc).__name__}: {exc}"})
        return None
    validation_log.write({"step": step, "epoch": epoch, **measured})
    log.info("step %d: held-out acceptance (one pass, %d turns of %d files) %s", step, measured["turns"],
             measured["files"], " ".join(f"k={k}: {v:.3f}" for k, v in measured["curve"].items()))
    return measured["curve"]


# ---- one step -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepResult:
    """One optimizer step on the global batch, as the training log records it."""

    loss: float  # sum_k w_k loss_k, the objective's step weights (TTT: 0.8^k; DFlash: exp(-(j-1)/gamma))
    loss_k: list[float]  # each TTT step's mean cross-entropy over the global batch's masked positions
    acc: list[float]
    grad_norm: float  # the global gradient's L2 norm before clipping (at or under grad_clip: not clipped)
    tokens: int  # loss-mask tokens of the global batch
    stop: bool = False  # a stop was asked for on some rank: every rank stops after this step


def global_sum(local: torch.Tensor, world: int) -> torch.Tensor:
    """``local`` summed over every rank (one all-reduce), in float64 so counts and sums stay exact."""
    total = local.detach().double()
    if world > 1:
        torch.distributed.all_reduce(total)
    return total


def row_seeds(s: Session, samples: list[int]) -> list[int]:
    """What each row of a step draws at random from (DFlash's anchors): the run's seed, the step and the row's
    sample, so a resumed step draws what the interrupted one did, and N processes draw what one does."""
    step = s.scheduler.last_epoch  # optimizer steps taken so far, restored on resume
    return [(s.cfg.seed * 1_000_003 + step) * 1_000_033 + sample for sample in samples]


def train_step(s: Session, batch: Batch, seeds: list[int]) -> StepResult:
    """One optimizer step on the global batch."""
    targets = make_targets(batch, s.lm_head, s.drafter.d2t, s.drafter.t2d)
    autocast = s.device.type == "cuda" or s.weights.compute_dtype is not None  # bf16 weights on the CPU too
    with torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=autocast):
        ce_sums, counts = s.objective(batch, targets, seeds=seeds)  # (K,), (3, K)
    k = ce_sums.shape[0]
    # The stop flag rides on the step's one all-reduce: every rank learns of a stop asked for on any of them.
    stop = ce_sums.new_tensor([1.0 if s.stop() else 0.0])
    total = global_sum(torch.cat([ce_sums.detach(), counts.flatten(), batch.loss_mask.sum().view(1), stop]), s.world)
    g_ce, (g_masked, g_hits, g_learned), g_tokens, g_stop = total[:k], total[k : 4 * k].view(3, k), total[-2], total[-1]
    weights = objective_of(s.objective).step_weights().to(total.device, total.dtype)
    # DDP averages gradients over ranks; times the world size, the gradient is that of the global mean.
    denominators = (g_masked.clamp(min=1) / s.world).to(ce_sums.dtype)
    loss = (weights.to(ce_sums.dtype) * ce_sums / denominators).sum()
    s.weights.zero_grad(s.optimizer)
    loss.backward()
    # After backward every rank holds DDP's averaged gradient, so this is the global batch's gradient norm.
    grad_norm = torch.nn.utils.clip_grad_norm_(s.weights.grads_to_optimizer(), s.cfg.grad_clip)
    s.optimizer.step()
    s.weights.after_update()
    s.scheduler.step()
    step_losses, accs = g_ce / g_masked.clamp(min=1), g_hits / g_learned.clamp(min=1)
    # One copy to the host for everything the log records: each float() would wait for the GPU again.
    host = torch.cat([(weights * step_losses).sum().view(1), step_losses, accs, grad_norm.double().view(1),
                      g_tokens.view(1), g_stop.view(1)]).tolist()
    return StepResult(host[0], [round(x, 6) for x in host[1 : 1 + k]], [round(x, 6) for x in host[1 + k : 1 + 2 * k]],
                      host[-3], int(host[-2]), host[-1] > 0)
