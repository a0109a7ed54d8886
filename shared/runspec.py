"""A run's settings, fixed at submission and stored as ``runs/<run>/run.json`` on the volume."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared import SCHEMA_VERSION
from shared.atomic import atomic_write_json, read_json
from shared.errors import RunNotFound
from shared.layout import RunPaths
from shared.lifecycle import Stage

DEFAULT_SPLIT = "train"  # the split a dataset on the hub names its training rows (not the train stage)
# A run's settings, a section per stage: the sample stages' are named for their work, the whole-run stages' for
# the stage itself. A retrain may change only the last two: the capture fixed the others.
# ``online`` says how the run keeps its hidden states (services/trainer/online.py).
SECTIONS = ("generation", "extraction", Stage.TRAIN.value, Stage.EVALUATE.value, "online")
RETRAIN_SECTIONS = (Stage.TRAIN.value, Stage.EVALUATE.value, "online")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class GenerationConfig(_Frozen):
    max_tokens: int = Field(512, ge=1, description="Longest reply requested from the target.")
    min_completion_tokens: int = Field(16, ge=0, description="Shorter replies are dropped, each named.")
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, le=2**62, description="Per-sample seed is seed + sample_id, so a rerun asks the same "
                      "question; bounded so the sum fits the int64 servers take.")
    turns: Literal["all", "last"] = Field(
        "all", description="all: the target writes every assistant turn of a conversation, turn by turn, each "
        "answering the conversation so far with its own earlier replies; last: only the reply to the last user "
        "turn, earlier assistant turns kept as the dataset wrote them.")
    max_turns: int | None = Field(
        None, ge=1, description="With turns=all: regenerate only a conversation's first N user turns and leave the "
        "rest out (each turn is a request, and later turns carry ever longer prompts); None: every turn.")
    replies: int = Field(
        1, ge=1, description="Samples each training prompt gives: its own reply (asked as temperature and top_p say, "
        "greedy by default) plus replies-1 sampled at reply_temperature and reply_top_p, each a sample of its own "
        "with its own id (sample_id), seed (seed + its id), files and failure record. Every reply costs a "
        "generation and an extraction; held-out rows get none.")
    reply_temperature: float = Field(
        1.0, ge=0, description="With replies > 1: the temperature of the sampled replies (1: the target's own "
        "distribution). Every turn a sampled sample writes is sampled, its earlier replies conditioning its later "
        "turns.")
    reply_top_p: float = Field(1.0, gt=0, le=1, description="With replies > 1: the sampled replies' nucleus.")

    @model_validator(mode="after")
    def _sampled_replies_differ(self) -> GenerationConfig:
        # At temperature 0 a server decodes greedily, so every sampled reply would repeat the prompt's own one:
        # replies-1 more generations and extractions of the same sample.
        if self.replies > 1 and self.reply_temperature == 0:
            raise ValueError(f"generation.replies {self.replies} with generation.reply_temperature 0: a reply at "
                             "temperature 0 repeats the greedy one; set reply_temperature above 0, or replies to 1")
        return self

    def sample_id(self, row: int, prompt_rows: int, reply: int = 0) -> int:
        """The sample id of ``reply`` (0: the row's own, 1..replies-1: sampled) of dataset row ``row``, where rows
        0..prompt_rows-1 come before the first held-out row.

        Their replies fill ids 0..replies*prompt_rows-1, reply r of row i at r*prompt_rows + i: a row's own reply
        keeps its row index, the id it has with replies 1. A later row (held out, or malformed after the first
        held-out one) has its one id past the sampled ones, at its index + (replies-1)*prompt_rows, so every held-out
        id stays above every trained one. ``RunSpec.reply_of`` is the inverse."""
        if not 0 <= reply < self.replies:
            raise ValueError(f"reply {reply} of a run with generation.replies {self.replies}")
        if row < prompt_rows:
            return row + reply * prompt_rows
        if reply:
            raise ValueError(f"row {row} comes after the first held-out row ({prompt_rows}): it has no sampled reply")
        return row + (self.replies - 1) * prompt_rows

    def for_reply(self, reply: int) -> GenerationConfig:
        """How reply ``reply`` is asked: the row's own (0) as the run says, a sampled one at reply_temperature and
        reply_top_p."""
        if reply == 0:
            return self
        return self.model_copy(update={"temperature": self.reply_temperature, "top_p": self.reply_top_p})

    def reply_label(self, row: int, reply: int) -> str:
        """How a failure names a sampled reply (its sample id alone does not say which row it answers); "" for a
        row's own reply, named as with replies 1."""
        return f"row {row}, sampled reply {reply} of {self.replies - 1}: " if reply else ""


# How hidden-state files store the states: in the dtype the target computes them in, or as fp8 (e4m3) with a
# bf16 scale per token and layer (shared.eagle3), half the bytes of bf16.
HiddenStorage = Literal["target", "fp8"]


class ExtractionConfig(_Frozen):
    layer_ids: list[int] | None = Field(None, description="Auxiliary layers; None takes [1, N//2-1, N-4].")
    max_length: int = Field(4096, ge=8, description="Samples longer than this (prompt + reply) are truncated.")
    storage: HiddenStorage = Field(
        "target", description="Hidden states in the target's dtype (bf16 on GPUs), or fp8: float8 e4m3 with a bf16 "
        "scale per token and layer, half the bytes of bf16 for about 2% relative error per value.")


DrafterMethod = Literal["eagle3", "dflash"]


class DFlashSettings(_Frozen):
    """The DFlash drafter's shape and objective (modeling/dflash.py); read only when train.method is dflash.
    It reads the same three auxiliary layers as EAGLE-3 (extraction.layer_ids), so one extraction trains both."""

    block_size: int = Field(8, ge=2, le=64, description="Anchor plus mask slots of one drafter pass; the drafter is "
                            "served with num_speculative_tokens = block_size - 1.")
    layers: int = Field(2, ge=1, le=16, description="Draft decoder layers (not measured against 1 yet).")
    anchors: int = Field(64, ge=1, description="Blocks trained per sample and step, at random loss-masked positions.")
    gamma: float | None = Field(None, gt=0, description="Decay of the mask slots' loss weights, exp(-(j-1)/gamma); "
                                "unset: the DFlash paper's value for the block size (4 for 8, 5 for 10, 7 for 16), "
                                "half the block otherwise.")
    causal: bool = Field(False, description="Mask slots see only earlier slots of their block (any "
                         "num_speculative_tokens up to block_size - 1 then serves what was trained); false: the "
                         "whole block, DFlash's default.")
    mask_token_id: int | None = Field(None, ge=0, description="The target id vLLM writes into mask slots; unset: the "
                                      "highest id that no training sample holds. A mask slot reads the target's own "
                                      "(frozen) embedding of it, as vLLM does.")


class TrainConfig(_Frozen):
    # Defaults measured on the real target (SmolLM2-135M, 5,000 prompts, one H200; bench/RESULTS.md): lr 5e-4
    # with 6 passes over 1.19M positions (about 7M in all) gave acceptance 2.82 on held-out prompts and 1.89 on
    # HumanEval at 7 draft tokens, against 2.45 and 1.74 for 4 passes (a sample of the same prompt source with
    # fewer code tasks), and prompt lookup's 1.33 and 1.71. lr 1.5e-3 fitted the training data faster on the
    # same files; its held-out acceptance is not measured yet. The old default, 1e-4, was never measured here.
    # Every lr measured trained batches of 16 (stdlib: 5e-4, the one evaluated; ShareGPT, 2026-12-05: 1e-3 over 5e-4 on
    # every held-out set). The default batch here is 4 a process, where no lr was measured, and a smaller batch
    # usually wants a smaller lr, so the default stays 5e-4; the README gives the chat recipe at batch 16.
    epochs: int | None = Field(
        None, ge=1, description="Passes over the data. Unset: as many as train about "
                                "AUTO_EPOCH_POSITIONS positions in all (services.trainer.sources.auto_epochs), at least "
                                "MIN_AUTO_EPOCHS (2) and at most MAX_AUTO_EPOCHS, so the number scales with the data.")
    batch_size: int = Field(4, ge=1, description="Samples per batch per training process (when max_tokens and "
                                                 "global_batch_size are unset).")
    global_batch_size: int | None = Field(
        None, ge=1, description="Samples per optimizer step over all training processes of all nodes; each process "
                                "trains its share (every N-th sample of the batch). Set, the steps do not depend on "
                                "the number of processes, so a run resumes on another number of GPUs or nodes; "
                                "unset, a step is batch_size per process and a resume needs the same number.")
    lr: float = Field(5e-4, gt=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    grad_clip: float = Field(0.5, gt=0)
    method: DrafterMethod = Field("eagle3", description="The drafter trained from the hidden states: eagle3 (a chain "
                                  "of one-token steps) or dflash (a block of tokens per pass; train.dflash).")
    dflash: DFlashSettings = Field(default_factory=DFlashSettings)
    ttt_steps: int = Field(7, ge=1, description="Training-time-test unroll length (eagle3).")
    max_length: int | None = Field(None, ge=8, description="Train on each sample's first max_length tokens; unset "
                                   "trains on every token extraction kept (extraction.max_length). A smaller value "
                                   "drops stored loss tokens, which the trainer logs as a warning with their count.")
    max_tokens: int | None = Field(None, ge=8, description="Token budget per batch per training process (samples x "
                                   "the longest, padding included); set, it replaces batch_size. A sample longer "
                                   "than the budget trains alone.")
    group_by_length: bool = Field(True, description="Batch samples of similar length together so batches pad little.")
    draft_vocab_size: int = Field(32000, ge=2, description="Capped at the target vocabulary size.")
    seed: int = 0
    save_every: int = Field(200, ge=1, description="Checkpoint every N optimizer steps (and at the end, and where a "
                                                  "stop is asked for: the worker's first SIGTERM).")
    save_every_s: float | None = Field(
        None, gt=0, description="Also checkpoint when this many seconds have passed since the last checkpoint "
                                "(unset: steps alone): a run whose steps take long loses at most this much to a crash.")
    validation_files: int = Field(
        0, ge=0, description="Hidden-state files held out of training (picked by a hash of their sample id); at "
                             "every checkpoint and at the end the drafter's acceptance curve over their assistant "
                             "turns is measured in one pass (services.trainer.validation): validation.jsonl and "
                             "the status page's val_accept<k>. 0: every file trains.")
    base_checkpoint: str | None = Field(None, description="Published drafter (repo id or path) to fine-tune.")
    attention: Literal["auto", "dense", "flex"] = Field(
        "auto", description="TTT attention of the chain steps: flex (block-sparse, compiled; CUDA), dense (any device, "
                            "the reference), auto (flex on CUDA, dense otherwise). Both compute the same function.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Weights a step computes with: fp32 (float32 weights; bf16 autocast on CUDA), or bf16 "
                            "(bf16 weights and gradients, float32 master copies in the optimizer and the checkpoints: "
                            "about 0.1-0.2 GiB less at 8B drafter shapes, no faster; bench/RESULTS.md; one training "
                            "process only).")
    loss: Literal["kl", "lk_lambda", "lk_alpha"] = Field(
        "kl", description="What each draft step's predictions are trained on (modeling/losses.py), over the same "
                          "positions: kl, the soft cross-entropy against the target's distribution over the draft "
                          "vocabulary; lk_lambda, the LK hybrid (arXiv 2602.23881) lam x that cross-entropy + "
                          "(1 - lam) x (1 - acceptance) per position, lam = exp(-lk_eta x acceptance), acceptance = "
                          "sum_x min(p(x), q(x)) the chance that the target accepts the drafted token under "
                          "rejection sampling; lk_alpha, -log(acceptance). Engines serve the drafter the same way "
                          "whichever it trained with.")
    lk_eta: float = Field(3.0, gt=0, description="lk_lambda: how fast each position's weight moves from the "
                          "cross-entropy to acceptance as its acceptance grows (3: the paper's setting and vLLM "
                          "speculators' default). Read only with loss lk_lambda.")
    aux_norm: bool = Field(
        False, description="EAGLE-3.1's normalized features: each of the three auxiliary states gets its own RMSNorm "
                           "before the drafter's fc; exported as config fc_norm: true with fc_norm.0/1/2.weight, which "
                           "vLLM 0.32 and SGLang 0.5.23 apply (README, \"Training objectives and normalized "
                           "features\"). eagle3 only, and not with a base_checkpoint, whose own config decides.")

    @model_validator(mode="after")
    def _one_batch_size(self) -> TrainConfig:
        if self.global_batch_size is not None and self.max_tokens is not None:
            raise ValueError("global_batch_size and max_tokens both size a batch: set one of them")
        if self.method == "dflash" and self.base_checkpoint:
            raise ValueError("train.method dflash trains from scratch: a base_checkpoint is an EAGLE-3 drafter's")
        return self

    @model_validator(mode="after")
    def _aux_norm_is_served(self) -> TrainConfig:
        # Refused at submission: a norm the export could not declare would be trained and never served.
        if self.aux_norm and self.method == "dflash":
            raise ValueError("train.aux_norm is the EAGLE-3 drafter's fc_norm; vLLM's DFlash drafter (qwen3_dflash) "
                             "reads no such norm, so a DFlash drafter trained with it would be served without it")
        if self.aux_norm and self.base_checkpoint:
            raise ValueError("train.aux_norm with a base_checkpoint: the base's own config.json (fc_norm) says "
                             "whether its auxiliary states are normalized, and fine-tuning keeps that")
        return self


class OnlineConfig(_Frozen):
    """Train while extracting, the run's hidden states bounded by a byte budget (services/trainer/online.py)."""

    enabled: bool = Field(False, description="Online: training starts once generation has settled and asks for each "
                          "sample's states in its own order, at most budget_bytes ahead; a file is deleted once the "
                          "step that read it is done, and each epoch (and a resume, for the steps after its "
                          "checkpoint) extracts the samples again from the stored replies. Offline (false): every "
                          "file is kept until training ends, and a retrain reuses them.")
    budget_bytes: int | None = Field(None, ge=1, description="Most bytes the run's hidden-state files hold at once "
                                     "(the held-out validation files included); unset: a quarter of the volume's free "
                                     "space less its reserve, fixed and shown at submission.")
    vocab_files: int = Field(256, ge=1, description="Not read: the draft vocabulary is counted from every training "
                             "sample's reply when the plan is made, as offline counts every file. Kept so runs "
                             "submitted with it still load.")


EvalSetName = Literal["holdout", "holdout_turn2", "humaneval"]  # evaluation/evalsets.py loads each
EVAL_SETS: tuple[str, ...] = get_args(EvalSetName)


class EvalConfig(_Frozen):
    holdout: int = Field(8, ge=0, description="Rows held out of training for evaluation.")
    max_new_tokens: int = Field(64, ge=1)
    draft_steps: int = Field(3, ge=1, description="Chain length proposed per verification step (the headline).")
    sets: list[EvalSetName] = Field(
        ["holdout", "humaneval"], min_length=1,
        description="Evaluation sets: the run's held-out rows (their first turns where every turn is regenerated), "
                    "their second turns after the target's own first reply (holdout_turn2), HumanEval's prompts (no "
                    "training row is any of them).")
    earlier_reply_tokens: int = Field(
        512, ge=1, description="holdout_turn2: most tokens of the target's greedy reply to the first turn, which "
                               "the second turn follows.")
    humaneval_limit: int | None = Field(None, ge=1, description="The first N HumanEval prompts; None takes all 164.")
    curve_max_steps: int = Field(7, ge=1, le=32, description="Acceptance curve over chain lengths 1..N.")
    baselines: bool = Field(True, description="Also decode without a drafter and with prompt lookup (n-gram).")
    decode: Literal["curve", "headline"] = Field(
        "curve", description="curve: every k of the curve is decoded and checked against greedy decoding, the one-pass "
                             "curve beside it as a check; headline: only draft_steps is decoded (and checked), the "
                             "curve's other k come from the one-pass curve, equal to decoding but for rounding "
                             "(evaluation.one_pass): three decodes of every prompt instead of "
                             "2 x curve_max_steps + 1, about a quarter of the time on an H200 (bench/RESULTS.md); "
                             "the report's measured_by says which k were decoded, and one_pass_apart how far the "
                             "two forms lie apart at draft_steps on these prompts.")
    lookup_min: int = Field(2, ge=1, description="Prompt lookup: shortest suffix n-gram matched (vLLM's prompt_lookup_min).")
    lookup_max: int = Field(5, ge=1, description="Prompt lookup: longest suffix n-gram matched (vLLM's prompt_lookup_max).")
    batch_prompts: int = Field(
        64, ge=1, description="Prompts decoded together, one row each: a small target's pass costs about the same for "
                              "one row as for many, so larger is faster until the KV cache fills the device.")
    batch_tokens: int = Field(
        131072, ge=1, description="Most positions (prompt and reply budget, times rows) decoded together: a batch of "
                                  "batch_prompts is cut into consecutive parts within it, so long prompts do not "
                                  "multiply the KV cache and hidden states by the whole batch's row count.")
    max_prompt_tokens: int = Field(
        2048, ge=1, description="Longest prompt measured, in tokens (a second turn's with the target's first reply; "
                                "lower where the target's context leaves less room for the reply): a longer one is "
                                "left out of its set, named in the report's too_long, instead of padding a whole "
                                "batch to its length (one held-out ShareGPT prompt of 33,837 tokens asked a batch of "
                                "256 for 273 GiB).")

    @property
    def chain_lengths(self) -> list[int]:
        """The k measured: 1 .. curve_max_steps, and the headline draft_steps where it lies beyond."""
        return sorted(set(range(1, self.curve_max_steps + 1)) | {self.draft_steps})

    @property
    def decoded_lengths(self) -> list[int]:
        """The k decoded: every k of the curve, or the headline alone (``decode``)."""
        return self.chain_lengths if self.decode == "curve" else [self.draft_steps]

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if len(set(self.sets)) != len(self.sets):
            raise ValueError(f"sets {self.sets} names a set twice")
        if self.lookup_min > self.lookup_max:
            raise ValueError(f"lookup_min {self.lookup_min} exceeds lookup_max {self.lookup_max}")
        return self


class RunSpec(_Frozen):
    schema_version: int = SCHEMA_VERSION
    name: str
    dataset: str = Field(..., description="Path to JSONL/Parquet, or a Hugging Face dataset repo id.")
    split: str = DEFAULT_SPLIT
    limit: int | None = None
    model: str = Field(..., description="Served model name the generator asks for.")
    created_at: float = Field(default_factory=time.time)
    rows: int = Field(0, ge=0, description="Sample ids 0..rows-1: one per row read from the dataset (malformed ones "
                      "included) and, with generation.replies > 1, one per sampled reply (GenerationConfig.sample_id).")
    train_ids: int = Field(0, ge=0, description="Sample ids 0..train_ids-1 go through generate and extract; the "
                           "held-out rows' ids lie above.")
    generation: GenerationConfig = GenerationConfig()
    extraction: ExtractionConfig = ExtractionConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvalConfig = EvalConfig()
    online: OnlineConfig = OnlineConfig()

    @model_validator(mode="after")
    def _second_turns_are_the_targets(self) -> RunSpec:
        # Refused at submission, not hours later when evaluation starts.
        if "holdout_turn2" in self.evaluate.sets and self.generation.turns != "all":
            raise ValueError('evaluation set holdout_turn2 needs generation.turns = "all": the drafter learns '
                             "later turns only from the target's own replies")
        return self

    @property
    def prompt_rows(self) -> int:
        """Dataset rows 0..prompt_rows-1 come before the first held-out row: each valid one is a training prompt with
        generation.replies sample ids (GenerationConfig.sample_id)."""
        return self.train_ids // self.generation.replies

    def reply_of(self, sample_id: int) -> tuple[int, int]:
        """``(dataset row, reply)`` of ``sample_id``: reply 0 is the row's own, 1..replies-1 its sampled ones."""
        rows = self.prompt_rows
        if sample_id >= self.train_ids or rows == 0:
            return sample_id - (self.generation.replies - 1) * rows, 0
        return sample_id % rows, sample_id // rows

    @property
    def train_max_length(self) -> int:
        """The tokens of each sample training reads: train.max_length, or all that extraction kept."""
        return self.extraction.max_length if self.train.max_length is None else self.train.max_length

    def save(self, data: Path) -> None:
        atomic_write_json(RunPaths(data, self.name).spec, self.model_dump(mode="json"))

    @classmethod
    def load(cls, data: Path, name: str) -> RunSpec:
        path = RunPaths(data, name).spec
        if not path.is_file():
            raise RunNotFound(f"no run {name!r} under {Path(data) / 'runs'}")
        raw = read_json(path)
        if isinstance(raw.get("generation"), dict):
            # A run saved before generation.turns existed regenerated the last turn only; it goes on so.
            raw["generation"].setdefault("turns", "last")
        return cls.model_validate(raw)


_CACHE: dict[tuple[str, str], tuple[float, RunSpec]] = {}


def cached_spec(data: Path, run: str) -> RunSpec:
    """RunSpec.load, cached per process for workers that read it per job; a rewritten run.json (new
    mtime) is read again."""
    try:
        mtime = RunPaths(data, run).spec.stat().st_mtime
    except FileNotFoundError:
        return RunSpec.load(data, run)  # raises RunNotFound with the path
    cached = _CACHE.get((str(data), run))
    if cached is None or cached[0] != mtime:
        cached = (mtime, RunSpec.load(data, run))
        _CACHE[(str(data), run)] = cached
    return cached[1]
