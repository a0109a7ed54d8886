"""A training session's set-up and resume: the data source, the drafter, the objective, the optimizer and its
schedule, restored from the run's latest checkpoint where there is one.

``prepare`` assembles a ``Session`` for the loop (``train.py``); ``trained_from_checkpoint`` rebuilds a finished
run's result from its last checkpoint, as the job that started a multi-process run exports it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from modeling.attention import avoid_cudnn_attention
from modeling.dflash import DFlashDrafter, DFlashObjective, default_gamma
from modeling.eagle3 import TargetTied
from modeling.losses import StepLoss
from modeling.methods import DFLASH, config_from_dict, new_drafter
from modeling.target_head import load_target_head, read_target_config, text_config
from modeling.ttt_attention import FLEX, attention_kind
from runtime.runstate import RunState
from runtime.space import SpaceHold, write_with_space
from services.trainer import checkpoint as ckpt
from services.trainer.data import list_hidden_files
from services.trainer.drafter_init import VOCAB_FROM_DATA, build_drafter, draft_vocab_source, expected_layer_ids
from services.trainer.objective import TTTObjective
from services.trainer.online_plan import plan_facts, read_plan
from services.trainer.online_source import record_online_facts, spool
from services.trainer.precision import Float32Weights, make_weights, precision_kind
from services.trainer.sources import AUTO_EPOCH_POSITIONS, Reading, Source, stored_files
from services.trainer.validation import Validation, validation_split
from shared import eagle3
from shared.errors import CheckpointFormatError, HiddenStateFileError
from shared.hidden_file import read_header
from shared.layout import RunPaths
from shared.runspec import RunSpec, TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainProgress:
    step: int
    total: int
    epoch: int
    loss: float
    acc: list[float]
    lr: float
    tokens_per_s: float = 0.0  # loss-mask tokens all ranks trained on per second since the session began
    padding: float = 0.0  # share of the epoch's computed positions that are padding (batching.Padding)
    validation: dict[str, float] | None = None  # the latest held-out one-pass curve, k -> acceptance length


ProgressFn = Callable[[TrainProgress], None]


@dataclass
class TrainResult:
    drafter: TargetTied  # Eagle3Drafter or DFlashDrafter (train.method)
    steps: int
    layer_ids: list[int]
    target_model: str
    target_fingerprint: str
    num_files: int
    last: TrainProgress | None = None
    draft_vocab: str = VOCAB_FROM_DATA  # where the draft vocabulary (d2t/t2d) came from


def dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def pick_device(name: str) -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)
    if device.type == "cuda":
        avoid_cudnn_attention()
    return device


@dataclass
class Session:
    """Everything one training run holds, assembled (and resumed) by ``prepare``."""

    cfg: TrainConfig
    paths: RunPaths
    device: torch.device
    drafter: TargetTied
    objective: nn.Module
    lm_head: torch.Tensor  # (V, H) the target's, on the device
    weights: Float32Weights  # what the step computes with and what the optimizer updates (precision)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    source: Source  # the stored files offline, the spool online (sources.py)
    total: int
    position: ckpt.Position
    rank: int = 0
    world: int = 1
    validation: Validation | None = None  # rank 0's held-out files (train.validation_files), else None
    space_hold: SpaceHold | None = None  # names the train stage held while a write waits for disk space
    stop: Callable[[], bool] = lambda: False  # a stop was requested: checkpoint at the next step boundary and go
    result: TrainResult = field(init=False)
    trained_to: ckpt.Position = field(init=False)  # after the last step taken: what a checkpoint now would record
    saved_at: float = field(init=False)  # when the last checkpoint was written (monotonic), for save_every_s
    saved_step: int = field(init=False)  # the step the last checkpoint holds

    def __post_init__(self) -> None:
        self.trained_to = self.position
        self.saved_at, self.saved_step = time.monotonic(), self.position.step

    @property
    def plans(self) -> list[list[list[int]]]:
        return self.source.plans

    def on_volume(self, what: str, write: Callable[[], object]) -> None:
        """Run the volume write ``write`` (atomic: a failed try leaves nothing), waiting out a full disk."""
        write_with_space(write, what, self.paths.data, hold=self.space_hold)


def prepare(spec: RunSpec, *, data: Path, model_dir: Path, device: str, state: RunState | None = None,
            stop: Callable[[], bool] = lambda: False, trust_remote_code: bool = False) -> Session:
    cfg, paths = spec.train, RunPaths(data, spec.name)
    rank, world = dist_info()
    dev = pick_device(device)
    target_config = read_target_config(model_dir)
    layer_ids = expected_layer_ids(spec, target_config)
    shape = {"world": world, "rank": rank, "layer_ids": layer_ids, "hidden_size": int(text_config(target_config)["hidden_size"]),
             "vocab_size": int(text_config(target_config)["vocab_size"])}
    source = (spool(spec, paths, state, model_dir=model_dir, trust_remote_code=trust_remote_code, **shape)
              if spec.online.enabled else stored_files(spec, paths, **shape))
    if source.mask_token_id is not None and cfg.dflash.mask_token_id is None:
        cfg = cfg.model_copy(update={"dflash": cfg.dflash.model_copy(update={"mask_token_id": source.mask_token_id})})
    head = load_target_head(model_dir, dtype=None)  # the target's own dtype: the head is (V, H), keep it small

    torch.manual_seed(cfg.seed)
    drafter, draft_vocab = build_drafter(cfg, data=data, model_dir=model_dir, target_config=target_config,
                                         layer_ids=layer_ids, embed=head.embed, tally=source.tally)
    record_online_facts(source, paths, drafter.config.mask_token_id if isinstance(drafter, DFlashDrafter) else None, rank)
    drafter.store_embedding_as(head.embed.dtype)
    drafter = drafter.to(dev)
    attention = attention_kind(cfg.attention, dev)
    precision = precision_kind(cfg.precision, world)
    weights = make_weights(drafter, precision)
    loss = StepLoss(cfg.loss, cfg.lk_eta)
    objective: nn.Module = (DFlashObjective(drafter, cfg.dflash.anchors, cfg.dflash.gamma or default_gamma(cfg.dflash.block_size),
                                            loss=loss)
                            if cfg.method == DFLASH else TTTObjective(drafter, cfg.ttt_steps, flex=attention == FLEX, loss=loss))
    if world > 1:
        # Gradients as views of DDP's all-reduce buckets: one copy of them in memory, not two.
        objective = nn.parallel.DistributedDataParallel(objective, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                        gradient_as_bucket_view=True)
    # The fused CUDA AdamW updates every tensor in a few kernels (the foreach one: 8.3 ms a step at 8B shapes,
    # fused 3.5; bench/RESULTS.md); it keeps the same state, so checkpoints move between the two.
    optimizer = torch.optim.AdamW(weights.optimizer_params, lr=cfg.lr, weight_decay=0.0, fused=dev.type == "cuda")
    total = sum(len(plan) for plan in source.plans)
    schedule = partial(warmup_cosine, warmup=math.ceil(cfg.warmup_ratio * total), total=total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    with weights.full_precision():
        position = resume(paths, cfg, total, world, drafter, optimizer, scheduler)
    validation = (Validation(source.held_out, spec.train_max_length, spec.evaluate.chain_lengths, dev)
                  if source.held_out and rank == 0 else None)
    session = Session(cfg, paths, dev, drafter, objective, head.lm_head.to(dev), weights, optimizer, scheduler, source,
                      total, position, rank, world, validation, stop=stop)
    meta = source.target_meta
    session.result = TrainResult(drafter, session.position.step, layer_ids, meta.get(eagle3.META_MODEL, spec.model),
                                 meta.get(eagle3.META_MODEL_FINGERPRINT, ""), len(source.files), draft_vocab=draft_vocab)
    objective_kind = "DFlash blocks" if cfg.method == DFLASH else f"EAGLE-3, {attention} TTT attention"
    objective_kind += f", loss {cfg.loss}" + (f" (eta {cfg.lk_eta})" if cfg.loss == "lk_lambda" else "")
    objective_kind += ", normalized auxiliary states (fc_norm)" if getattr(drafter.config, "aux_norm", False) else ""
    log.info("training %s: %d files of up to %d tokens (%d held out for validation), %d epochs%s, %s batches, %d steps, "
             "starting at step %d, %s, %s weights%s", spec.name, len(source.files), spec.train_max_length,
             len(source.held_out), source.epochs,
             "" if cfg.epochs is not None else f" (unset: about {AUTO_EPOCH_POSITIONS:,} positions over "
                                               f"{source.positions:,} a pass)",
             source.batching, total, session.position.step, objective_kind, precision,
             f", online within {spec.online.budget_bytes:,} bytes" if spec.online.enabled else "")
    return session


def warmup_cosine(step: int, *, warmup: int, total: int) -> float:
    """LR factor: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def open_source(s: Session, checkpoint_now: Callable[[], None]) -> None:
    """The session's source, opened where training resumes."""
    s.source.open(Reading(s.rank, s.world, s.device, s.position, s.stop, checkpoint_now))


def resume(paths: RunPaths, cfg: TrainConfig, total: int, world: int, drafter: TargetTied,
           optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> ckpt.Position:
    """Restore the latest checkpoint, if any; a checkpoint of a differently sized run is an error, and so is
    one written by another number of processes unless both train one global_batch_size (otherwise its data
    position counts global batches of another size)."""
    found = ckpt.latest_checkpoint(paths.checkpoints_dir)
    if found is None:
        return ckpt.Position(0, 0, 0)
    state = ckpt.read_checkpoint_state(found)
    saved_world = state.get("world_size", 1)
    saved_global = state.get("global_batch_size")
    if saved_world != world and (cfg.global_batch_size is None or saved_global != cfg.global_batch_size):
        raise CheckpointFormatError(
            f"{found}: written by {saved_world} training processes with "
            f"{'batch_size per process' if saved_global is None else f'global_batch_size {saved_global}'}, this run "
            f"has {world}; set DRAFTLINE_TRAIN_PROCS (and the node count) to {saved_world} processes in all to resume, "
            "or remove the checkpoints to start over (a run with train.global_batch_size resumes on any number)")
    saved_total = state.get("total_steps")
    if saved_total != total:
        raise CheckpointFormatError(f"{found}: made for {saved_total} steps, this run now has {total}; remove the checkpoints to start over")
    position = ckpt.load_checkpoint(found, drafter=drafter, optimizer=optimizer, scheduler=scheduler)
    log.info("run %s: resuming from step %d of %d on %d training processes (the checkpoint's: %d) (%s)",
             paths.run, position.step, total, world, saved_world, found)
    return position


def trained_from_checkpoint(spec: RunSpec, *, data: Path, model_dir: Path) -> TrainResult:
    """A finished run's result rebuilt from its last checkpoint, as the job that started a multi-process
    run exports it: the trained weights, the target's embedding, and the target named by the data."""
    paths = RunPaths(data, spec.name)
    found = ckpt.latest_checkpoint(paths.checkpoints_dir)
    if found is None:
        raise CheckpointFormatError(f"{paths.checkpoints_dir}: no checkpoint to export")
    drafter = new_drafter(config_from_dict(ckpt.read_checkpoint_state(found)["config"]))
    state = ckpt.load_weights(found, drafter)
    step, total = state["position"]["step"], state.get("total_steps")
    if step != total:
        raise CheckpointFormatError(f"{found}: training stopped at step {step} of {total}")
    drafter.load_embedding(load_target_head(model_dir, dtype=None).embed)
    if spec.online.enabled:  # its files are gone; the plan recorded the target and the samples
        facts, trained = plan_facts(paths) or {}, read_plan(paths).train_ids
        return TrainResult(drafter, step, list(drafter.config.layer_ids), facts.get("target_model", spec.model),
                           facts.get("target_fingerprint", ""), len(trained), draft_vocab=VOCAB_FROM_DATA)
    files, _ = validation_split(list_hidden_files(paths), spec.train.validation_files)  # what ``prepare`` trained on
    if not files:
        raise HiddenStateFileError(f"{paths.hidden_dir}: no hidden-state files")
    meta = read_header(files[0])[0].get("__metadata__", {})  # the file ``prepare`` takes them from
    return TrainResult(drafter, step, list(drafter.config.layer_ids), meta.get(eagle3.META_MODEL, spec.model),
                       meta.get(eagle3.META_MODEL_FINGERPRINT, ""), len(files), draft_vocab=draft_vocab_source(spec.train, data))

