"""The training loop: EAGLE-3 training-time test (TTT) over a run's verified hidden-state files.

Alignment (one sample of tokens x_0..x_{L-1}; the target's aux states f_t and final-norm states g_t at
position t have seen x_0..x_t, and softmax(lm_head(g_t)) is the target's distribution for x_{t+1}):

    step k, index t      input hidden   input token   RoPE position   predicts   target distribution
    0                    fc(f_t)        x_{t+1}       t               x_{t+2}    softmax(lm_head(g_{t+1}))
    k >= 1               out_{k-1}[t]   x_{t+1+k}     t + k           x_{t+2+k}  softmax(lm_head(g_{t+1+k}))

- Step 0 pairs the target's state at t with the *next* token, as vLLM's proposer does (it shifts the
  token ids left by one and puts the target's freshly sampled token last).
- Step k >= 1 feeds back step k-1's output at the same index (the pre-norm hidden state, as the engines
  feed back), with the teacher-forced token; the chain at index t is the draft the serving engine makes
  after the target has verified x_0..x_{t+1}. Positions advance by one per step (vLLM: ``positions += 1``).
- Attention: step k's query at index t sees step 0's keys at indices <= t (the drafter's cache over the
  verified prefix) and the keys of steps 1..k at index t (its own chain), as in SpecForge's cache_hidden
  attention. The older EAGLE code that also masked step 0's diagonals hid valid context (SafeAILab/EAGLE
  PR #299); we do not.
- Loss of step k at index t counts when the predicted token x_{t+2+k} is loss-masked (a token the
  drafter learns: ``loss_mask[t+2+k]``, the mask of the label, never of the input token x_{t+1+k}) and
  the target's argmax at t+1+k lies in the draft vocabulary. It is the cross-entropy
  of the drafter's distribution against the target's softmax restricted to the draft vocabulary;
  total = sum_k 0.8^k L_k. acc_k = share of loss-masked predictions whose drafter argmax (as a target id)
  equals the target's argmax, counted over all masked positions, so tokens outside the draft vocabulary
  count as misses, as they do at serving time.

At the prompt/reply boundary (prompt x_0..x_{P-1}, first reply token x_P): a prompt token is never a
label (its mask is 0), so no step learns to predict the prompt. The first reply token's target
distribution is the last prompt position's, softmax(lm_head(g_{P-1})), and step 0 learns it at index
P-2, from f_{P-2} and the last prompt token x_{P-1}. Serving never drafts x_P (the target's prefill
samples it): the first draft is step 0 at index P-1, from f_{P-1} and x_P, predicting x_{P+1}, which is
what ``evaluate.DrafterProposer`` feeds (``extend`` pairs position p with x_{p+1}, the target's newest
token last) and what vLLM's EAGLE proposer feeds. The k + 1 chains of step k that start inside the
prompt (indices P-2-k .. P-2) are trained though never served; they are a few positions per reply.
The last k + 2 indices of a sample have no label at step k (x_L is not stored).
tests/services/trainer/test_alignment.py pins both: which mask entries gate which loss positions, and
that training's step-k logits at index t equal the proposer's chain step k after verifying x_0..x_{t+1}.

Data order (batching.py): global batches of samples of similar length, each sample once per epoch, the
same on every rank and after a resume; each rank takes a strided share of every global batch.

Data parallel (DDP, several processes started by torchrun): each rank trains on its slice of every global
batch, the objective is one ``nn.Module`` call (so DDP can wrap it), and only rank 0 writes logs and
checkpoints. The loss of a step is a mean over the *global* batch's masked tokens: ranks hold different
token counts, so the mean of per-rank means would weight a short sample's tokens more than one process
does. Each rank therefore divides its token sums by the all-reduced count and scales by the world size,
which DDP's gradient average undoes; N processes then take the steps one process takes on the same
global batches, up to float32 summation order.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from shared import eagle3
from shared.atomic import atomic_write_text
from shared.drafter_format import TargetFacts, check_base_fits, check_drafter, mapping_tensors, read_config
from shared.errors import BaseCheckpointMismatch, CheckpointFormatError, HiddenStateFileError, UnsupportedRopeScaling
from shared.fingerprint import model_fingerprint
from shared.hidden_file import read_header
from shared.layout import RunPaths, resolve_inside
from shared.runspec import RunSpec, TrainConfig
from services.trainer import checkpoint as ckpt
from services.trainer.batching import batch_padding, plan_padding, share
from services.trainer.data import Batch, HiddenStateDataset, collate, list_hidden_files
from modeling.dflash import DFlashConfig, DFlashDrafter, DFlashObjective, default_gamma
from modeling.export import load_drafter
from modeling.losses import soft_cross_entropy
from modeling.methods import DFLASH, config_from_dict, new_drafter
from modeling.eagle3 import DrafterConfig, Eagle3Drafter, TargetTied, rope_scaling_of, ttt_unroll
from services.trainer.precision import Float32Weights, make_weights, precision_kind
from modeling.target_head import load_target_head, read_target_config, target_logits, text_config
from modeling.ttt_attention import FLEX, attention_kind
from services.trainer.online import Feed, global_span, load_plan, plan_facts
from services.trainer.train_data import (AUTO_EPOCH_POSITIONS, offline_data, online_data,
                                         record_online_facts)
from services.trainer.validation import Validation, validation_split
from services.trainer.vocab import TokenTally, build_mapping, draft_to_target
from modeling.attention import avoid_cudnn_attention
from runtime.runstate import RunState
from runtime.space import SpaceHold, append_line, write_with_space

log = logging.getLogger(__name__)

STEP_DECAY = 0.8
LOADER_WORKERS = 4  # per training process on a GPU: a 2,048-token 8B-shape sample is 66 MB to read and pad
LOADER_PREFETCH = 2  # batches each worker keeps ready
VOCAB_FROM_BASE = "base checkpoint"  # the base checkpoint's own d2t/t2d, kept as it is
VOCAB_FROM_DATA = "training data"  # the most frequent loss-masked target tokens of this run's files


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


# ---- targets and the TTT objective ---------------------------------------------------------------

@dataclass
class Targets:
    probs: torch.Tensor  # (B, L, Vd) target softmax over the draft vocabulary, at each position
    argmax: torch.Tensor  # (B, L) the target's greedy next token (target id)
    in_draft: torch.Tensor  # (B, L) bool, that token has a draft id


TARGET_CHUNK = 1024  # positions per target-logit product: (chunk, V) at a time, not (B, L, V) in float32


@torch.no_grad()
def make_targets(batch: Batch, lm_head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> Targets:
    """The target's next-token facts at every position, ``TARGET_CHUNK`` positions at a time: a (B, L, V)
    float32 product of a 128k vocabulary is 2 GiB at L = 4,096, the largest tensor of a step otherwise."""
    b, length, _ = batch.last_hidden.shape
    hidden = batch.last_hidden.reshape(b * length, -1)  # (B*L, H)
    columns = draft_to_target(d2t)  # (Vd,) target ids of the draft vocabulary
    probs = torch.empty(b * length, columns.shape[0], dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(b * length, dtype=torch.long, device=hidden.device)
    for start in range(0, b * length, TARGET_CHUNK):
        rows = slice(start, start + TARGET_CHUNK)
        logits = target_logits(lm_head, hidden[rows])  # (chunk, V) float32, exact copies of the head's dtype
        argmax[rows] = logits.argmax(-1)
        probs[rows] = logits[:, columns].softmax(-1)
    argmax = argmax.view(b, length)
    return Targets(probs=probs.view(b, length, -1), argmax=argmax, in_draft=t2d[argmax])


class TTTObjective(nn.Module):
    """The whole unroll as one module call, so DDP can wrap it.

    Returns this rank's sums, which ``train_step`` turns into means over the global batch: the masked
    cross-entropy sum of each step (K,) with its graph, and (3, K) counts without one: masked positions,
    argmax hits and loss-masked predictions per step.

    Step k's loss at index t needs the label x_{t+2+k}, so only the first L - k - 2 indices have one; the
    logits and the loss are computed over those, against views of the targets shifted by k + 1 (no copy),
    and ``losses.soft_cross_entropy`` keeps only the logits for the backward.
    """

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, flex: bool = False) -> None:
        super().__init__()
        self.drafter = drafter
        self.ttt_steps = ttt_steps
        self.flex = flex  # ttt_attention's block-sparse form of the chain steps' attention (CUDA)

    def unroll(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor) -> list[torch.Tensor]:
        """Step k's output at every index: ``ttt_steps`` x (B, L, H), aligned as the module doc says."""
        return ttt_unroll(self.drafter, input_ids, aux_hidden, self.ttt_steps, flex=self.flex)

    def step_weights(self) -> torch.Tensor:
        return STEP_DECAY ** torch.arange(self.ttt_steps, dtype=torch.float64)  # total = sum_k 0.8^k L_k

    def forward(self, batch: Batch, targets: Targets, seeds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seeds  # the unroll draws nothing at random (DFlashObjective's anchors do)
        d = self.drafter
        length = batch.input_ids.shape[1]
        ce_sums, counts = [], []
        for k, hidden in enumerate(self.unroll(batch.input_ids, batch.aux_hidden)):
            n = max(length - k - 2, 0)  # indices t whose label x_{t+2+k} is stored
            labelled = slice(k + 1, k + 1 + n)  # the target's facts at t+1+k, whose next token is that label
            learned = batch.loss_mask[:, k + 2 : k + 2 + n]  # (B, n): the label is a token the drafter learns
            mask = learned & targets.in_draft[:, labelled]
            logits = d.logits(hidden[:, :n])  # (B, n, Vd)
            ce_sums.append(soft_cross_entropy(logits, targets.probs[:, labelled], mask))
            with torch.no_grad():
                hit = d.to_target_ids(logits.argmax(-1)) == targets.argmax[:, labelled]  # (B, n)
                counts.append(torch.stack([mask.sum(), (hit & learned).sum(), learned.sum()]))
        return torch.stack(ce_sums), torch.stack(counts, dim=1).float()  # (K,), (3, K)


# ---- schedule, logging --------------------------------------------------------------------------

def warmup_cosine(step: int, *, warmup: int, total: int) -> float:
    """LR factor: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


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


# ---- setup --------------------------------------------------------------------------------------

def dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(local: torch.Tensor, world: int) -> torch.Tensor:
    """``local`` summed over every rank (one all-reduce), in float64 so counts and sums stay exact."""
    total = local.detach().double()
    if world > 1:
        dist.all_reduce(total)
    return total


def expected_layer_ids(spec: RunSpec, target_config: dict) -> list[int]:
    layers = int(text_config(target_config)["num_hidden_layers"])
    ids = spec.extraction.layer_ids or eagle3.default_layer_ids(layers)
    return eagle3.check_layer_ids(list(ids), layers)


def base_checkpoint_dir(data: Path, value: str) -> Path:
    """The base checkpoint's directory on the volume; CheckpointFormatError naming the value otherwise (a
    run submitted with ``force`` can carry any string here: a NUL byte, a 300-character name)."""
    try:
        base = resolve_inside(data, value)
        found = base.is_dir()
    except (ValueError, OSError) as exc:  # PathOutsideVolume is a DraftlineError and passes through
        raise CheckpointFormatError(f"base checkpoint {value[:200]!r}: not a usable path ({exc})") from None
    if not found:
        raise CheckpointFormatError(f"base checkpoint {value!r}: no directory at {base} (download it onto the volume first)")
    return base


def check_base_checkpoint(cfg: TrainConfig, *, data: Path, model_dir: Path, target_config: dict,
                          layer_ids: list[int]) -> Path | None:
    """The base checkpoint's directory once it is a drafter that fits the target (hidden size, vocabulary,
    layers, the recorded fingerprint) and reads this run's layers; None for a run without one. Checked
    before any training, by the job itself, so a mismatch fails the run by name."""
    if not cfg.base_checkpoint:
        return None
    base = base_checkpoint_dir(data, cfg.base_checkpoint)
    config = read_config(base)
    check_drafter(base, config)
    ids = check_base_fits(base, config, TargetFacts.from_config(target_config, model_fingerprint(model_dir)))
    if ids != layer_ids:
        raise BaseCheckpointMismatch(f"base checkpoint {base} reads the outputs of layers {ids}, this run extracted "
                                     f"{layer_ids} (extraction.layer_ids)")
    return base


def draft_vocab_source(cfg: TrainConfig, data: Path) -> str:
    """Where the run's draft vocabulary comes from: a base checkpoint's d2t/t2d, else the training data."""
    if cfg.base_checkpoint and mapping_tensors(base_checkpoint_dir(data, cfg.base_checkpoint)):
        return VOCAB_FROM_BASE
    return VOCAB_FROM_DATA


def data_mapping(tally: TokenTally, config: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The most frequent learned tokens over the rows training reads (each file's first ``max_length``)."""
    return build_mapping(tally.counts, config.draft_vocab_size)


def build_drafter(cfg: TrainConfig, *, data: Path, model_dir: Path, target_config: dict, layer_ids: list[int],
                  embed: torch.Tensor, tally: TokenTally) -> tuple[TargetTied, str]:
    """A fresh drafter with a draft vocabulary from the training files, or the base checkpoint with its own
    (one from the files if it has none); and where the vocabulary came from."""
    if cfg.method == DFLASH:
        return build_dflash(cfg, target_config=target_config, layer_ids=layer_ids, embed=embed,
                            tally=tally), VOCAB_FROM_DATA
    base = check_base_checkpoint(cfg, data=data, model_dir=model_dir, target_config=target_config, layer_ids=layer_ids)
    if base is None:
        config = DrafterConfig.from_target_config(target_config, draft_vocab_size=cfg.draft_vocab_size, layer_ids=layer_ids)
        drafter = Eagle3Drafter(config)
        drafter.load_embedding(embed)
        drafter.set_vocab_mapping(*data_mapping(tally, config))
        return drafter, VOCAB_FROM_DATA
    drafter = load_drafter(base, model_dir, embed=embed)
    warn_on_rope_difference(base, drafter.config, target_config)
    if draft_vocab_source(cfg, data) == VOCAB_FROM_BASE:
        log.info("fine-tuning %s, keeping its draft vocabulary of %d", base, drafter.config.draft_vocab_size)
        return drafter, VOCAB_FROM_BASE
    drafter.set_vocab_mapping(*data_mapping(tally, drafter.config))
    log.warning("fine-tuning %s: it has no d2t/t2d, so its draft vocabulary of %d is computed from this run's %d "
                "training files; its lm_head rows are taken to follow that mapping", base,
                drafter.config.draft_vocab_size, tally.files)
    return drafter, VOCAB_FROM_DATA


def build_dflash(cfg: TrainConfig, *, target_config: dict, layer_ids: list[int], embed: torch.Tensor,
                 tally: TokenTally) -> DFlashDrafter:
    """A fresh DFlash drafter of the target's width over the same auxiliary layers as EAGLE-3, its draft
    vocabulary and mask token taken from the training files."""
    base = DrafterConfig.from_target_config(target_config, draft_vocab_size=cfg.draft_vocab_size, layer_ids=layer_ids)
    settings = cfg.dflash
    mask = settings.mask_token_id if settings.mask_token_id is not None else tally.unused()
    config = DFlashConfig(base, num_layers=settings.layers, block_size=settings.block_size, mask_token_id=mask,
                          causal=settings.causal)
    drafter = DFlashDrafter(config)
    drafter.load_embedding(embed)
    drafter.set_vocab_mapping(*data_mapping(tally, base))
    log.info("DFlash drafter: %d layers, blocks of %d (%s), mask token %d, %d anchors a sample", config.num_layers,
             config.block_size, "causal" if config.causal else "bidirectional", mask, settings.anchors)
    return drafter


def warn_on_rope_difference(base: Path, config: DrafterConfig, target_config: dict) -> None:
    """A base keeps its own RoPE and length (its weights learned them); say so when the target's differ."""
    text = text_config(target_config)
    ours = (config.rope_scaling, config.max_position_embeddings)
    try:
        target_rope = rope_scaling_of(text)
    except UnsupportedRopeScaling:
        target_rope = text.get("rope_scaling") or text.get("rope_parameters")
    theirs = (target_rope, int(text.get("max_position_embeddings", config.max_position_embeddings)))
    if ours != theirs:
        log.warning("base checkpoint %s has rope_scaling %s and max_position_embeddings %d, the target %s and %d; "
                    "the drafter keeps the base's", base, ours[0], ours[1], theirs[0], theirs[1])


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
    dataset: HiddenStateDataset
    lengths: list[int]  # tokens of each sample training reads, in dataset order
    plans: list[list[list[int]]]  # each epoch's global batches (batching.plan_epoch)
    total: int
    position: ckpt.Position
    batching: str
    rank: int = 0
    world: int = 1
    validation: Validation | None = None  # rank 0's held-out files (train.validation_files), else None
    space_hold: SpaceHold | None = None  # names the train stage held while a write waits for disk space
    feed: Feed | None = None  # an online run's spool (services/trainer/online.py); None offline
    result: TrainResult = field(init=False)
    trained_to: ckpt.Position = field(init=False)  # after the last step taken: what a checkpoint now would record

    def __post_init__(self) -> None:
        self.trained_to = self.position

    def on_volume(self, what: str, write: Callable[[], object]) -> None:
        """Run the volume write ``write`` (atomic: a failed try leaves nothing), waiting out a full disk."""
        write_with_space(write, what, self.paths.data, hold=self.space_hold)


def prepare(spec: RunSpec, *, data: Path, model_dir: Path, device: str, state: RunState | None = None) -> Session:
    cfg, paths = spec.train, RunPaths(data, spec.name)
    rank, world = dist_info()
    dev = pick_device(device)
    target_config = read_target_config(model_dir)
    layer_ids = expected_layer_ids(spec, target_config)
    hidden_size = int(text_config(target_config)["hidden_size"])
    max_length = spec.train_max_length
    shape = {"world": world, "rank": rank, "layer_ids": layer_ids, "hidden_size": hidden_size,
             "vocab_size": int(text_config(target_config)["vocab_size"])}
    data_in = (online_data(spec, paths, state, **shape) if spec.online.enabled
               else offline_data(spec, paths, **shape))
    files, held_out, lengths = data_in.files, data_in.held_out, data_in.lengths
    if data_in.mask_token_id is not None and cfg.dflash.mask_token_id is None:
        cfg = cfg.model_copy(update={"dflash": cfg.dflash.model_copy(update={"mask_token_id": data_in.mask_token_id})})
    head = load_target_head(model_dir, dtype=None)  # the target's own dtype: the head is (V, H), keep it small

    torch.manual_seed(cfg.seed)
    drafter, draft_vocab = build_drafter(cfg, data=data, model_dir=model_dir, target_config=target_config,
                                         layer_ids=layer_ids, embed=head.embed, tally=data_in.tally)
    record_online_facts(data_in, paths, drafter, rank)
    drafter.store_embedding_as(head.embed.dtype)
    drafter = drafter.to(dev)
    attention = attention_kind(cfg.attention, dev)
    precision = precision_kind(cfg.precision, world)
    weights = make_weights(drafter, precision)
    objective: nn.Module = (DFlashObjective(drafter, cfg.dflash.anchors, cfg.dflash.gamma or default_gamma(cfg.dflash.block_size))
                            if cfg.method == DFLASH else TTTObjective(drafter, cfg.ttt_steps, flex=attention == FLEX))
    if world > 1:
        # Gradients as views of DDP's all-reduce buckets: one copy of them in memory, not two.
        objective = nn.parallel.DistributedDataParallel(objective, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                        gradient_as_bucket_view=True)
    # The fused CUDA AdamW updates every tensor in a few kernels (the foreach one: 8.3 ms a step at 8B shapes,
    # fused 3.5; bench/RESULTS.md); it keeps the same state, so checkpoints move between the two.
    optimizer = torch.optim.AdamW(weights.optimizer_params, lr=cfg.lr, weight_decay=0.0, fused=dev.type == "cuda")
    epochs, plans, batching = data_in.epochs, data_in.plans, data_in.batching
    total = sum(len(plan) for plan in plans)
    schedule = partial(warmup_cosine, warmup=math.ceil(cfg.warmup_ratio * total), total=total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    with weights.full_precision():
        position = resume(paths, cfg, total, world, drafter, optimizer, scheduler)
    validation = (Validation(held_out, max_length, spec.evaluate.chain_lengths, dev)
                  if held_out and rank == 0 else None)
    if data_in.feed is not None:
        data_in.feed.settle(position.epoch, position.batch_in_epoch, global_span(cfg, world))
    session = Session(cfg, paths, dev, drafter, objective, head.lm_head.to(dev), weights, optimizer, scheduler,
                      HiddenStateDataset(files, max_length), lengths, plans, total, position, batching, rank, world,
                      validation, feed=data_in.feed)
    meta = data_in.target_meta
    session.result = TrainResult(drafter, session.position.step, layer_ids, meta.get(eagle3.META_MODEL, spec.model),
                                 meta.get(eagle3.META_MODEL_FINGERPRINT, ""), len(files), draft_vocab=draft_vocab)
    objective_kind = "DFlash blocks" if cfg.method == DFLASH else f"EAGLE-3, {attention} TTT attention"
    log.info("training %s: %d files of up to %d tokens (%d held out for validation), %d epochs%s, %s batches, %d steps, "
             "starting at step %d, %s, %s weights", spec.name, len(files), max_length, len(held_out), epochs,
             "" if cfg.epochs is not None else f" (unset: about {AUTO_EPOCH_POSITIONS:,} positions over "
                                               f"{data_in.positions:,} a pass{', estimated' if data_in.feed else ''})",
             batching, total, session.position.step, objective_kind, precision)
    return session


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
        facts, trained = plan_facts(paths) or {}, load_plan(paths, spec, rank=1).train_ids
        return TrainResult(drafter, step, list(drafter.config.layer_ids), facts.get("target_model", spec.model),
                           facts.get("target_fingerprint", ""), len(trained), draft_vocab=VOCAB_FROM_DATA)
    files, _ = validation_split(list_hidden_files(paths), spec.train.validation_files)  # what ``prepare`` trained on
    if not files:
        raise HiddenStateFileError(f"{paths.hidden_dir}: no hidden-state files")
    meta = read_header(files[0])[0].get("__metadata__", {})  # the file ``prepare`` takes them from
    return TrainResult(drafter, step, list(drafter.config.layer_ids), meta.get(eagle3.META_MODEL, spec.model),
                       meta.get(eagle3.META_MODEL_FINGERPRINT, ""), len(files), draft_vocab=draft_vocab_source(spec.train, data))


# ---- the loop -----------------------------------------------------------------------------------

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


def train_drafter(spec: RunSpec, *, data: Path, model_dir: Path, device: str = "auto", progress: ProgressFn | None = None,
                  space_hold: SpaceHold | None = None, state: RunState | None = None) -> TrainResult:
    """Train (or resume training) the run's drafter; checkpoints every ``save_every`` steps and at the end. A
    write that finds the volume full waits for space, with ``space_hold`` naming the stage held. An online run
    (``online.enabled``) reads its states as its trainer asks for them, through the run's ``state``."""
    s = prepare(spec, data=data, model_dir=model_dir, device=device, state=state)
    s.space_hold = space_hold
    train_log = TrainLog(s.paths.train_log, s.position.step, enabled=s.rank == 0, on_volume=s.on_volume)
    validation_log = TrainLog(s.paths.validation_log, s.position.step, enabled=s.validation is not None,
                              on_volume=s.on_volume)
    validation = None
    step, started = s.position.step, time.monotonic() - s.position.elapsed_s
    tokens, session_start = 0, time.monotonic()
    span = global_span(s.cfg, s.world)
    for epoch in range(s.position.epoch, len(s.plans)):
        plan = s.plans[epoch]
        padding = plan_padding(plan, s.lengths, s.world) if s.feed is None else None
        if s.rank == 0 and padding is not None:
            log.info("epoch %d: %d batches, %d real of %d computed tokens (padding %.1f%%)",
                     epoch, len(plan), padding.real, padding.computed, 100 * padding.fraction)
        elif s.rank == 0:
            log.info("epoch %d: %d batches of %d samples, online (seeded order, states asked for as it goes)",
                     epoch, len(plan), span)
        first = s.position.batch_in_epoch if epoch == s.position.epoch else 0
        trained_in_epoch = sum(len(b) for b in plan[:first])
        for index, batch in enumerate(epoch_loader(s, plan, first, epoch), start=first):
            online = s.feed.read(epoch, index) if s.feed is not None else None
            global_batch = plan[index] if online is None else online[0]
            part = share(global_batch, s.rank, s.world)
            if part.filler:
                batch = batch.without_loss()
            done = train_step(s, batch.to(s.device, None if s.device.type == "cuda" else torch.float32),
                              row_seeds(s, part.indices))
            step += 1
            tokens += done.tokens
            trained_in_epoch += len(global_batch)
            speed = tokens / max(time.monotonic() - session_start, 1e-9)
            step_padding = (batch_padding(plan[index], s.lengths, s.world).fraction if online is None
                            else float(1 - batch.lengths.sum() / max(1, batch.lengths.numel() * int(batch.lengths.max()))))
            s.result.last = TrainProgress(step, s.total, epoch, done.loss, done.acc, s.scheduler.get_last_lr()[0], speed,
                                          padding.fraction if padding is not None else step_padding, validation)
            record = {"step": step, "epoch": epoch, "loss": done.loss, "loss_k": done.loss_k, "acc": done.acc,
                      "grad_norm": done.grad_norm, "lr": s.result.last.lr, "padding": round(step_padding, 6),
                      "elapsed_s": round(time.monotonic() - started, 3)}
            if online is not None:  # each epoch's multiset of samples, on the volume; tokens: what the run learned
                record.update(samples=online[1], tokens=done.tokens)
            train_log.write(record)
            following = (epoch, index + 1) if index + 1 < len(plan) else (epoch + 1, 0)
            s.trained_to = ckpt.Position(step, *following, round(time.monotonic() - started, 3))
            checkpoint = s.rank == 0 and (step % s.cfg.save_every == 0 or step == s.total)
            if checkpoint and s.validation is not None:
                validation = measure_held_out(s, step, epoch, validation_log)  # None: no current figure, not a stale one
                s.result.last = replace(s.result.last, validation=validation)
            if progress is not None and s.rank == 0:
                progress(s.result.last)
            if checkpoint:
                save_checkpoint(s, s.trained_to)
            if s.feed is not None:
                s.feed.ask_ahead(*following, span)
                s.feed.report(epoch, trained_in_epoch)
    if s.feed is not None:
        s.feed.report(len(s.plans) - 1, trained_in_epoch if s.plans else 0, force=True)
    s.weights.finish()
    s.result.steps = step
    return s.result


def save_checkpoint(s: Session, position: ckpt.Position, why: str = "") -> None:
    """Rank 0's checkpoint at ``position``; online, the files its steps read are released after it."""
    with s.weights.full_precision():
        s.on_volume(f"checkpoint step {position.step}", partial(
            ckpt.save_checkpoint, s.paths.checkpoint(position.step), drafter=s.drafter, optimizer=s.optimizer,
            scheduler=s.scheduler, position=position,
            extra={"total_steps": s.total, "world_size": s.world, "batching": s.batching,
                   "global_batch_size": s.cfg.global_batch_size,
                   **({"online": {"order": "seeded permutation of each epoch", "seed": s.cfg.seed}}
                      if s.feed is not None else {})}))
    if s.feed is not None:
        freed = s.feed.released_after_checkpoint(position.epoch, position.batch_in_epoch, global_span(s.cfg, s.world))
        log.info("step %d: checkpoint%s; %d files read before it released", position.step, why, freed)


def relieve_spool(s: Session) -> None:
    """A checkpoint where training stands, out of schedule: the spool is full of files already read."""
    if s.trained_to.step > 0 and ckpt.latest_checkpoint(s.paths.checkpoints_dir) != s.paths.checkpoint(s.trained_to.step):
        save_checkpoint(s, s.trained_to, " (the spool is full of files already read)")


def epoch_loader(s: Session, plan: list[list[int]], first: int, epoch: int = 0) -> DataLoader:
    """This rank's shares of the epoch's global batches from batch ``first`` on; online, each waited for as the
    loader asks for it."""
    if s.feed is None:
        shares = [share(batch, s.rank, s.world).indices for batch in plan[first:]]
    else:
        shares = _online_shares(s, len(plan), first, epoch)
    if s.device.type != "cuda":
        return DataLoader(s.dataset, batch_sampler=shares, collate_fn=collate, num_workers=0)
    # Workers read and pad the next batches while the GPU works, into pinned memory so the copy to the GPU
    # is asynchronous (a pageable copy of an 8B-shape sample held the step for 8 ms).
    return DataLoader(s.dataset, batch_sampler=shares, collate_fn=collate, num_workers=LOADER_WORKERS,
                      prefetch_factor=LOADER_PREFETCH, pin_memory=True)


def _online_shares(s: Session, batches: int, first: int, epoch: int):
    """The online run's shares, each global batch waited for on the volume when the loader reaches it."""
    assert s.feed is not None
    span = global_span(s.cfg, s.world)
    for index in range(first, batches):
        yield share(s.feed.wait_for(epoch, index, span, relieve=lambda: relieve_spool(s)), s.rank, s.world).indices


@dataclass(frozen=True)
class StepResult:
    """One optimizer step on the global batch, as the training log records it."""

    loss: float  # sum_k w_k loss_k, the objective's step weights (TTT: 0.8^k; DFlash: exp(-(j-1)/gamma))
    loss_k: list[float]  # each TTT step's mean cross-entropy over the global batch's masked positions
    acc: list[float]
    grad_norm: float  # the global gradient's L2 norm before clipping (at or under grad_clip: not clipped)
    tokens: int  # loss-mask tokens of the global batch


def objective_of(s: Session) -> TTTObjective | DFlashObjective:
    return s.objective.module if isinstance(s.objective, nn.parallel.DistributedDataParallel) else s.objective


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
    total = global_sum(torch.cat([ce_sums.detach(), counts.flatten(), batch.loss_mask.sum().view(1)]), s.world)
    g_ce, (g_masked, g_hits, g_learned), g_tokens = total[:k], total[k : 4 * k].view(3, k), total[-1]
    weights = objective_of(s).step_weights().to(total.device, total.dtype)
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
                      g_tokens.view(1)]).tolist()
    return StepResult(host[0], [round(x, 6) for x in host[1 : 1 + k]], [round(x, 6) for x in host[1 + k : 1 + 2 * k]],
                      host[-2], int(host[-1]))
