"""One run through a local stack, start to end: what ``make demo`` and the whole-pipeline benchmark share.

Starts every service as compose would (services.cli.stack), submits the run through the controller's API
with a fresh API token, prints a progress line whenever it changes, and times each stage as the
follower sees it: a stage's time runs from the moment its previous stage finished (the submission, for
generation) to the first poll that finds it finished, so the times add up to the run's wall time, at
the polling interval's resolution. Generation and extraction overlap (extraction starts on the first
generated samples), so extraction's time is what it took past the end of generation.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.cli.api import ControllerClient
from services.cli.stack import LocalStack, StackConfig
from shared.errors import DraftlineError
from shared.lifecycle import Outcome, RunPhase, Stage, StageState

log = logging.getLogger(__name__)

POLL_S = 1.0


class PipelineFailed(DraftlineError):
    """The run did not reach a terminal state in time, or ended without an exported drafter."""


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass
class PipelineSpec:
    """What to run: a target directory, a dataset on the volume, and the run's settings."""

    data: Path
    model_dir: Path
    dataset: Path
    run: dict[str, Any]
    name: str
    timeout_s: float = 900.0
    # Processes per service (StackConfig.replicas): {"inference": 4} runs four model servers, and every
    # worker spreads its requests over all four.
    replicas: dict[str, int] = field(default_factory=lambda: {"generator": 1, "extractor": 1})
    env: dict[str, str] = field(default_factory=dict)
    replica_env: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # StackConfig.replica_env


@dataclass
class PipelineResult:
    status: dict[str, Any]
    stage_seconds: dict[str, float]
    wall_seconds: float
    log_dir: Path


class StageClock:
    """Seconds per stage, from the end of the one before to the first status that shows it finished."""

    def __init__(self) -> None:
        self.start = self.mark = time.monotonic()
        self.seconds: dict[str, float] = {}

    def observe(self, status: dict[str, Any]) -> None:
        now = time.monotonic()
        for stage in Stage:
            if stage in self.seconds:
                continue
            if not stage_finished(status, stage):
                return  # stages finish in order; a later one waits for this one
            self.seconds[stage] = round(now - self.mark, 1)
            self.mark = now


def stage_finished(status: dict[str, Any], stage: Stage) -> bool:
    s = status["stages"][stage]
    if Stage(stage).per_sample:
        return s["total"] > 0 and s.get("remaining", s["total"] - s[Outcome.DONE]) == 0
    return s.get("state") in (StageState.DONE, StageState.SKIPPED, StageState.FAILED)


def run_pipeline(spec: PipelineSpec) -> PipelineResult:
    """Run ``spec`` to its end; raise PipelineFailed when it does not finish with an exported drafter."""
    data = spec.data.resolve()
    config = StackConfig(data=data, model_dir=spec.model_dir, log_dir=data / "logs" / spec.name,
                         api_token=secrets.token_urlsafe(32), replicas=dict(spec.replicas), env=dict(spec.env),
                         replica_env={name: list(envs) for name, envs in spec.replica_env.items()})
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with LocalStack(config) as stack, ControllerClient(stack.url("controller"), token=config.api_token) as api:
        say(f"services up ({len(stack.urls('inference'))} inference server(s)); logs in {config.log_dir}; "
            f"status page {stack.url('controller')}/status")
        api.submit({"dataset": str(spec.dataset), "name": spec.name, **spec.run})
        say(f"submitted run {spec.name}")
        clock = StageClock()
        status = follow(stack, api, spec.name, clock, timeout_s=spec.timeout_s)
    wall = round(time.monotonic() - clock.start, 1)
    drafter = status["drafter"]
    if status["state"] == RunPhase.FAILED or not drafter.get("export_path"):
        raise PipelineFailed(f"run {spec.name} ended as {status['state']} without an exported drafter; "
                             f"logs in {config.log_dir}")
    return PipelineResult(status=status, stage_seconds=clock.seconds, wall_seconds=wall, log_dir=config.log_dir)


def follow(stack: LocalStack, api: ControllerClient, name: str, clock: StageClock, *, timeout_s: float) -> dict:
    """Print a progress line whenever it changes, until the run reaches a terminal state."""
    from services.controller.runs.status import format_status

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        stack.check_alive()
        status = api.run_status(name)
        clock.observe(status)
        line = progress_line(status)
        if line != last:
            say(line)
            last = line
        if RunPhase(status["state"]).terminal:
            say(format_status(status))
            return status
        time.sleep(POLL_S)
    raise PipelineFailed(f"run {name} did not finish within {timeout_s:.0f}s; logs in {stack.config.log_dir}")


def progress_line(status: dict) -> str:
    stages = status["stages"]
    parts = [f"[{status['state']}]"]
    for stage in Stage:
        s = stages[stage]
        parts.append(f"{stage} {s[Outcome.DONE]}/{s['total']}")
    parts.append(f"errors {status['errors']['total']}")
    return "  ".join(parts)


def stage_table(result: PipelineResult) -> list[str]:
    """``stage  seconds  share`` lines, the slowest stage named last."""
    lines = []
    for stage in Stage:
        seconds = result.stage_seconds.get(stage)
        share = f"{100 * seconds / result.wall_seconds:4.0f}%" if seconds is not None and result.wall_seconds else "   -"
        lines.append(f"  {stage:<9} {'-' if seconds is None else f'{seconds:7.1f}s'}  {share}")
    if result.stage_seconds:
        slowest = max(result.stage_seconds, key=result.stage_seconds.get)
        lines.append(f"  slowest: {slowest}; wall time {result.wall_seconds:.0f}s (stage times as the demo saw them)")
    return lines


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
