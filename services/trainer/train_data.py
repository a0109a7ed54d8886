"""What a training session reads: the files of an offline run (every one verified before training starts) or an
online run's plan and feed (services/trainer/online.py), with the draft vocabulary's tally, the epochs and each
epoch's global batches. ``train.py`` trains on what ``offline_data`` or ``online_data`` returns."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from modeling.dflash import DFlashDrafter
from modeling.eagle3 import TargetTied
from runtime.runstate import RunState
from runtime.space import write_with_space
from services.trainer import checkpoint as ckpt
from services.trainer.batching import BATCHINGS, LENGTH, SHUFFLE, plan_epoch
from services.trainer.data import check_alike, list_hidden_files, loss_tokens_beyond, verify_files
from services.trainer.online import (
    Feed,
    OnlinePlan,
    OnlinePlanError,
    global_span,
    load_plan,
    online_epoch_plan,
    plan_facts,
    record_facts,
    wait_for_facts,
)
from services.trainer.validation import validation_split
from services.trainer.vocab import TokenTally
from shared import eagle3
from shared.errors import CheckpointFormatError
from shared.hidden_file import HiddenFileInfo, verify_hidden_file
from shared.layout import RunPaths
from shared.runspec import RunSpec, TrainConfig

log = logging.getLogger(__name__)

# On SmolLM2-135M (bench/RESULTS.md, 2026-12-02) 6 passes over 1.19M positions beat 4: the acceptance still
# rose with more training there, so an unset ``train.epochs`` trains about that many positions in all. A
# smaller dataset gets more passes, up to a cap that is a guard, not a measurement: a dataset that small
# trains a weak drafter however often it is seen, and the run says so (services.trainer.jobs.too_small_warning).
# A larger one gets fewer, but never one: on ShareGPT (2026-12-05) 3 passes over 2.4M positions beat 2 on every
# held-out set, and 2 passes over 10.7M were still gaining on held-out conversations when the schedule ended,
# where the positions rule alone would have stopped after one.
AUTO_EPOCH_POSITIONS = 7_000_000
MIN_AUTO_EPOCHS = 2
MAX_AUTO_EPOCHS = 10


def auto_epochs(configured: int | None, positions_per_epoch: int) -> int:
    """``train.epochs`` when set; otherwise the passes that train about AUTO_EPOCH_POSITIONS positions, at least
    MIN_AUTO_EPOCHS."""
    if configured is not None:
        return configured
    return max(MIN_AUTO_EPOCHS, min(MAX_AUTO_EPOCHS, math.ceil(AUTO_EPOCH_POSITIONS / max(1, positions_per_epoch))))



@dataclass
class TrainData:
    """What a session trains on: the files (offline) or the plan and its feed (online), and the epochs' batches."""

    files: list[Path]  # in dataset order: plans index into it
    held_out: list[Path]  # the validation files (train.validation_files)
    tally: TokenTally  # what the draft vocabulary is counted from (nothing on an online resume: the checkpoint has it)
    lengths: list[int]  # tokens of each file training reads; empty online (learned as files land)
    epochs: int
    plans: list[list[list[int]]]
    batching: str
    target_meta: dict[str, str]  # the hidden-state files' metadata: the target's name and fingerprint
    positions: int  # tokens an epoch trains (online: estimated from the vocabulary's files)
    feed: Feed | None = None
    mask_token_id: int | None = None  # online DFlash: the mask token the first start chose


def offline_data(spec: RunSpec, paths: RunPaths, *, world: int, rank: int, layer_ids: list[int],
                 hidden_size: int, vocab_size: int) -> TrainData:
    """Every file of the run, verified before training starts."""
    cfg, max_length = spec.train, spec.train_max_length
    files, held_out = validation_split(list_hidden_files(paths), cfg.validation_files)
    infos = verify_files([*files, *held_out], layer_ids=layer_ids, hidden_size=hidden_size)[: len(files)]
    if rank == 0:
        report_truncation(infos, max_length, spec)
    lengths = [min(info.num_tokens, max_length) for info in infos]
    batching = checkpoint_batching(paths, cfg)
    epochs = auto_epochs(cfg.epochs, sum(lengths))
    plans = [epoch_plan(cfg, lengths, epoch, world, batching) for epoch in range(epochs)]
    return TrainData(files, held_out, TokenTally(vocab_size, max_length, files), lengths, epochs, plans, batching,
                     infos[0].metadata, sum(lengths))


def online_data(spec: RunSpec, paths: RunPaths, state: RunState | None, *, world: int, rank: int,
                layer_ids: list[int], hidden_size: int, vocab_size: int) -> TrainData:
    """The online plan, its held-out files and, on the first start, the draft vocabulary counted from the first
    files of the first epoch as they land (services/trainer/online.py)."""
    if state is None:
        raise OnlinePlanError(f"run {spec.name} trains online: its trainer needs the run's Redis state")
    cfg, max_length = spec.train, spec.train_max_length
    plan = load_plan(paths, spec, rank)
    samples = len(plan.train_ids)
    feed = Feed(state, plan, [online_epoch_plan(cfg, samples, 0, world)], rank, int(spec.online.budget_bytes or 0))
    feed.start()
    feed.wait_ready(plan.validation_ids)
    feed.plan = OnlinePlan(plan.train_ids, [i for i in plan.validation_ids if i not in feed.failed])
    held_out = [paths.hidden(i) for i in feed.plan.validation_ids]
    if held_out:
        verify_files(held_out, layer_ids=layer_ids, hidden_size=hidden_size)  # the run's target and layers
    facts = plan_facts(paths)
    tally = TokenTally(vocab_size, max_length)
    fresh = facts is None or ckpt.latest_checkpoint(paths.checkpoints_dir) is None
    if fresh and rank != 0:
        # Rank 0 counts the files as they land and lets some go; its tally and facts are every rank's.
        facts = wait_for_facts(paths)
        tally = TokenTally.load(paths.online_vocabulary, max_length)
    elif fresh:
        counted = count_vocabulary(feed, spec, tally, layer_ids=layer_ids, hidden_size=hidden_size, world=world)
        # Like every trainer write, a full volume makes it wait for space, not fail.
        write_with_space(lambda: tally.save(paths.online_vocabulary), "the online vocabulary's tally", paths.data)
        if facts is None:
            per_sample = sum(min(i.num_tokens, max_length) for i in counted) / len(counted)
            positions = int(per_sample * samples)
            meta = counted[0].metadata
            facts = {"epochs": auto_epochs(cfg.epochs, positions), "positions": positions,
                     "target_model": meta.get(eagle3.META_MODEL, spec.model),
                     "target_fingerprint": meta.get(eagle3.META_MODEL_FINGERPRINT, "")}
    epochs = int(facts["epochs"])
    feed.plans = [online_epoch_plan(cfg, samples, epoch, world) for epoch in range(epochs)]
    target_meta = {eagle3.META_MODEL: facts["target_model"], eagle3.META_MODEL_FINGERPRINT: facts["target_fingerprint"]}
    return TrainData([paths.hidden(i) for i in plan.train_ids], held_out, tally, [], epochs, feed.plans, SHUFFLE,
                     target_meta, int(facts["positions"]), feed, facts.get("mask_token_id"))


def count_vocabulary(feed: Feed, spec: RunSpec, tally: TokenTally, *, layer_ids: list[int], hidden_size: int,
                     world: int) -> list[HiddenFileInfo]:
    """Count the draft vocabulary over the first ``online.vocab_files`` samples of the first epoch, one file at a
    time as each lands: the first ones training reads stay (as many as the budget holds less one file, the one being
    counted), and a file beyond them is let go once counted (no step has read it; training asks for it again when it
    comes), so the count needs no more room than the budget; their infos."""
    span = global_span(spec.train, world)
    ids = feed.upcoming(0, 0, min(len(feed.plan.train_ids), spec.online.vocab_files))
    counted: list[HiddenFileInfo] = []
    for position, sample_id in enumerate(ids):
        ahead = feed.ahead(span)
        if feed.leader:
            feed.ask(ids[position:position + ahead], ahead=True)
        feed.wait_ready([sample_id])
        if sample_id in feed.failed:
            continue
        path = feed.paths.hidden(sample_id)
        info = verify_hidden_file(path, layer_ids=layer_ids, hidden_size=hidden_size)
        if counted:
            check_alike(counted[0], info)
        tally.add(path)
        counted.append(info)
        if feed.leader and position >= ahead - 1:
            feed.let_go(sample_id)
    feed.evicted.clear()  # training asks for them again as it comes to them
    if not counted:
        raise OnlinePlanError(f"run {spec.name}: none of the first {len(ids)} samples of the first epoch could be "
                              "extracted (failures/extract names each)")
    interval = spec.train.save_every * span
    room = (feed.budget - feed.held_bytes) // max(feed.mean_bytes, 1.0)
    if room < span:
        raise OnlinePlanError(f"online.budget_bytes {feed.budget:,} holds about {int(room)} files of {feed.mean_bytes:,.0f} "
                              f"bytes beside the {len(feed.plan.validation_ids)} held-out ones, and a batch reads "
                              f"{span} at once: raise the budget, or lower train.batch_size or train.validation_files")
    if room < interval:
        log.warning("online.budget_bytes %d holds about %d files beside the held-out ones, and the %d steps between "
                    "checkpoints read about %d: the trainer checkpoints whenever the spool fills with files it has "
                    "read (raise the budget or lower train.save_every to checkpoint less often)", feed.budget,
                    int(room), spec.train.save_every, interval)
    log.info("draft vocabulary counted over %d files of the first epoch (online.vocab_files %d)", tally.files,
             spec.online.vocab_files)
    return counted


def record_online_facts(data_in: TrainData, paths: RunPaths, drafter: TargetTied, rank: int) -> None:
    """Rank 0 records what its first start measured and chose, for every resume (``online.plan_facts``)."""
    if data_in.feed is None or rank != 0 or plan_facts(paths) is not None:
        return
    facts = {"epochs": data_in.epochs, "positions": data_in.positions,
             "target_model": data_in.target_meta[eagle3.META_MODEL],
             "target_fingerprint": data_in.target_meta[eagle3.META_MODEL_FINGERPRINT],
             "vocab_files": data_in.tally.files}
    if isinstance(drafter, DFlashDrafter):
        facts["mask_token_id"] = drafter.config.mask_token_id
    record_facts(paths, facts)


def report_truncation(infos: list[HiddenFileInfo], max_length: int, spec: RunSpec) -> None:
    """A train.max_length under what extraction kept leaves stored loss tokens untrained: say how many."""
    files, tokens = loss_tokens_beyond(infos, max_length)
    if files:
        log.warning("train.max_length %d is below extraction.max_length %d: %d of %d files are cut, and %d stored "
                    "loss tokens past position %d are never trained on (leave train.max_length unset to train on them)",
                    max_length, spec.extraction.max_length, files, len(infos), tokens, max_length)


def checkpoint_batching(paths: RunPaths, cfg: TrainConfig) -> str:
    """The batch order a run trains in: its latest checkpoint's (a run resumes in the order it started
    in; checkpoints that name none predate length grouping), otherwise the one its settings ask for."""
    found = ckpt.latest_checkpoint(paths.checkpoints_dir)
    if found is None:
        return LENGTH if cfg.group_by_length else SHUFFLE
    batching = ckpt.read_checkpoint_state(found).get("batching", SHUFFLE)
    if batching not in BATCHINGS:
        raise CheckpointFormatError(f"{found}: unknown batching {batching!r}")
    return batching


def epoch_plan(cfg: TrainConfig, lengths: list[int], epoch: int, world: int, batching: str) -> list[list[int]]:
    """The epoch's global batches. With ``global_batch_size`` they are the batches one process would train
    with that batch size, whatever the number of processes, each of which takes its share by stride; so
    the steps, and a checkpoint's data position, mean the same on any number of processes."""
    if cfg.global_batch_size is not None:
        return plan_epoch(lengths, seed=cfg.seed, epoch=epoch, batch_size=cfg.global_batch_size, world=1,
                          batching=batching)
    return plan_epoch(lengths, seed=cfg.seed, epoch=epoch, batch_size=cfg.batch_size, world=world,
                      max_tokens=cfg.max_tokens, batching=batching)

