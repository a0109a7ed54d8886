"""Where everything lives on the data volume (``DRAFTLINE_DATA``).

    <data>/
      models/                               built-in tiny target (make demo) or other local models
      runs/<run>/
        run.json                            the RunSpec: dataset, expected rows, generation and training settings
        prompts.jsonl                       normalized prompt rows: {"sample_id": i, "messages": [...]}
        eval_prompts.jsonl                  held-out rows for evaluation, same format
        generated/rows_000000-001999/00000123.json         the target's reply for sample 123
        hidden_states/rows_000000-001999/00000123.safetensors
        failures/<stage>/00000123.json      a named failure: sample id, stage, error class, message
        drafter/checkpoints/step_00000100/  trainer checkpoints
        drafter/export/                     config.json + model.safetensors, loadable by vLLM and SGLang
        drafter/train_log.jsonl             loss, per-step accuracy, gradient norm per optimizer step
        drafter/validation.jsonl            held-out one-pass acceptance curve at each checkpoint (train.validation_files)
        eval.json                           acceptance length against the target

Sample ids are dataset row indices, and with ``generation.replies`` > 1 also the sampled replies' ids
(``GenerationConfig.sample_id``); a shard directory holds ``SHARD_SIZE`` consecutive ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shared.errors import PathOutsideVolume

SHARD_SIZE = 2000
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")  # a finished checkpoint's directory (RunPaths.checkpoint)


def shard_name(sample_id: int, shard_size: int = SHARD_SIZE) -> str:
    """``rows_000000-001999`` for ids 0..1999."""
    start = (sample_id // shard_size) * shard_size
    return f"rows_{start:06d}-{start + shard_size - 1:06d}"


def sample_stem(sample_id: int) -> str:
    return f"{sample_id:08d}"


def check_run_name(name: str) -> str:
    if not RUN_NAME_RE.match(name) or ".." in name:
        raise ValueError(
            f"invalid run name {name!r}: use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def resolve_inside(root: Path, candidate: str | Path) -> Path:
    """Resolve ``candidate`` (relative to ``root``, or absolute) and refuse anything outside ``root``."""
    root = Path(root).resolve()
    path = Path(candidate)
    resolved = (path if path.is_absolute() else root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise PathOutsideVolume(f"path {str(candidate)!r} resolves to {resolved}, outside the data volume {root}")
    return resolved


@dataclass(frozen=True)
class RunPaths:
    """Paths of one run on the volume."""

    data: Path
    run: str

    @property
    def root(self) -> Path:
        return Path(self.data) / "runs" / self.run

    @property
    def spec(self) -> Path:
        return self.root / "run.json"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def eval_prompts(self) -> Path:
        """Held-out prompts, never trained on, in the line format of ``prompts.jsonl``."""
        return self.root / "eval_prompts.jsonl"

    @property
    def generated_dir(self) -> Path:
        return self.root / "generated"

    @property
    def hidden_dir(self) -> Path:
        return self.root / "hidden_states"

    @property
    def failures_dir(self) -> Path:
        return self.root / "failures"

    @property
    def drafter_dir(self) -> Path:
        return self.root / "drafter"

    @property
    def checkpoints_dir(self) -> Path:
        return self.drafter_dir / "checkpoints"

    @property
    def export_dir(self) -> Path:
        return self.drafter_dir / "export"

    @property
    def train_log(self) -> Path:
        return self.drafter_dir / "train_log.jsonl"

    @property
    def online_plan(self) -> Path:
        """An online run's training ids, held-out ids and target, fixed when its training first starts."""
        return self.drafter_dir / "online_plan.json"

    @property
    def online_vocabulary(self) -> Path:
        """An online run's draft-vocabulary tally, counted by rank 0 on its first start, read by the other ranks."""
        return self.drafter_dir / "online_vocabulary.safetensors"

    @property
    def validation_log(self) -> Path:
        return self.drafter_dir / "validation.jsonl"

    @property
    def eval_report(self) -> Path:
        return self.root / "eval.json"

    @property
    def engine_log(self) -> Path:
        """The log of the vLLM server an evaluation starts to measure the export (``eval_vllm_command``)."""
        return self.root / "eval-vllm.log"

    def generated(self, sample_id: int) -> Path:
        return self.generated_dir / shard_name(sample_id) / f"{sample_stem(sample_id)}.json"

    def hidden(self, sample_id: int) -> Path:
        return self.hidden_dir / shard_name(sample_id) / f"{sample_stem(sample_id)}.safetensors"

    def hidden_relative(self, sample_id: int) -> str:
        """The hidden-state path relative to the volume root, as sent to the inference server."""
        return str(self.hidden(sample_id).relative_to(self.data))

    def failure(self, stage: str, sample_id: int) -> Path:
        return self.failures_dir / stage / f"{sample_stem(sample_id)}.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:08d}"

    def checkpoint_steps(self) -> list[int]:
        """The steps of the run's finished checkpoints, in order (a temp directory being written is not one)."""
        if not self.checkpoints_dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.checkpoints_dir.iterdir()
                      if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir())


def runs_root(data: Path) -> Path:
    return Path(data) / "runs"


def hidden_state_run(data: Path, path: Path) -> str | None:
    """The run whose hidden-state directory holds the file ``path`` (``<data>/runs/<run>/hidden_states/…``),
    or None; ``data`` and ``path`` are compared as given, so resolve both first."""
    try:
        parts = Path(path).relative_to(runs_root(data)).parts
    except ValueError:
        return None
    if len(parts) < 3:
        return None
    try:
        run = check_run_name(parts[0])
    except ValueError:
        return None
    return run if RunPaths(Path(data), run).hidden_dir in Path(path).parents else None


def list_runs(data: Path) -> list[str]:
    root = runs_root(data)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "run.json").is_file())
