"""``make demo``: the whole pipeline on the tiny built-in target, on this machine, no GPU, no Docker.

Starts Redis if none is reachable and every service with the commands docker-compose.yml runs, builds
the tiny target if absent, submits a run of the shipped prompts through the controller's API, shows
progress, and ends by printing the exported drafter and its acceptance length.

The demo's controller runs as the compose stack's does: with an API token (a fresh random one per demo,
which the demo sends) and reading datasets only from ``<data>/datasets``, where the shipped prompts are
copied.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import time
from importlib import resources
from pathlib import Path

from services.cli.api import ControllerClient
from services.cli.stack import LocalStack, StackConfig
from services.inference.tiny_model import is_model_dir, make_tiny_model
from shared.atomic import atomic_write_bytes, read_json
from shared.errors import DraftlineError
from shared.layout import RunPaths

log = logging.getLogger(__name__)

TERMINAL_STATES = {"complete", "complete_with_failures", "failed"}

# Small enough for a 2-core machine in a few minutes, large enough that the drafter learns something.
DEMO_RUN = {
    "generation": {"max_tokens": 48, "min_completion_tokens": 8, "temperature": 0.0},
    "train": {"epochs": 6, "batch_size": 8, "lr": 2e-3, "ttt_steps": 3, "draft_vocab_size": 256,
              "max_length": 256, "save_every": 50},
    # Both sets and both baselines, few enough prompts to evaluate in a couple of minutes on 2 cores.
    "evaluate": {"holdout": 8, "max_new_tokens": 48, "draft_steps": 3, "humaneval_limit": 4},
}


class DemoFailed(DraftlineError):
    """The demo run did not finish."""


def demo_prompts_path() -> Path:
    return Path(str(resources.files("shared").joinpath("data/demo_prompts.jsonl")))


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ensure_tiny_model(data: Path) -> Path:
    model_dir = data / "models" / "tiny"
    if is_model_dir(model_dir):
        say(f"tiny target: {model_dir} (already built)")
    else:
        say(f"building the tiny target in {model_dir} …")
        make_tiny_model(model_dir)
    return model_dir


def run_demo(data: Path, *, timeout_s: float = 600.0) -> dict:
    """Run the demo; return the final status. Raises DemoFailed if it does not complete."""
    data = data.resolve()
    data.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_tiny_model(data)
    dataset = place_dataset(data)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    config = StackConfig(data=data, model_dir=model_dir, log_dir=data / "logs" / f"demo-{stamp}",
                         api_token=secrets.token_urlsafe(32))
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with LocalStack(config) as stack, ControllerClient(stack.url("controller"), token=config.api_token) as api:
        say(f"services up; logs in {config.log_dir}; status page {stack.url('controller')}/status")
        name = f"demo-{stamp}"
        submit(api, dataset, name)
        status = follow(stack, api, name, timeout_s=timeout_s)
    report(status, data)
    return status


def place_dataset(data: Path) -> Path:
    """The shipped prompts in the volume's dataset folder, the one place the controller reads datasets from."""
    target = data / "datasets" / demo_prompts_path().name
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, demo_prompts_path().read_bytes())
    return target


def submit(api: ControllerClient, dataset: Path, name: str) -> None:
    api.submit({"dataset": str(dataset), "name": name, **DEMO_RUN})
    say(f"submitted run {name}")


def follow(stack: LocalStack, api: ControllerClient, name: str, *, timeout_s: float) -> dict:
    """Print a progress line whenever it changes, until the run reaches a terminal state."""
    from services.controller.status import format_status

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        stack.check_alive()
        status = api.run_status(name)
        line = _progress_line(status)
        if line != last:
            say(line)
            last = line
        if status["state"] in TERMINAL_STATES:
            say(format_status(status))
            return status
        time.sleep(1.0)
    raise DemoFailed(f"run {name} did not finish within {timeout_s:.0f}s; logs in {stack.config.log_dir}")


def _progress_line(status: dict) -> str:
    stages = status["stages"]
    parts = [f"[{status['state']}]"]
    for stage in ("generate", "extract", "train", "evaluate"):
        s = stages[stage]
        parts.append(f"{stage} {s['done']}/{s['total']}")
    parts.append(f"errors {status['errors']['total']}")
    return "  ".join(parts)


def report(status: dict, data: Path) -> None:
    """The exported drafter, its headline acceptance length, and per evaluation set the curve over k with
    the baselines measured on the same prompts (from the run's eval.json)."""
    drafter = status["drafter"]
    if status["state"] == "failed" or not drafter.get("export_path"):
        raise DemoFailed(f"run {status['run']} ended as {status['state']} without an exported drafter")
    say("")
    say(f"exported drafter: {drafter['export_path']}")
    say(f"acceptance length: {drafter['acceptance_length']:.2f} (tokens per target forward pass, greedy chain)")
    path = RunPaths(data, status["run"]).eval_report
    if not path.is_file():
        return
    for name, one in read_json(path).get("sets", {}).items():
        methods, check = one["methods"], one["greedy_check"]
        plain = methods.get("no_drafter", {}).get("acceptance_length")
        say(f"\n{name}: {len(one['prompts'])} prompts, {check['matched']}/{check['checked']} decodes equal to greedy")
        say(f"  {'k':>3} | {'drafter':>7} | {'lookup':>7} | {'no-drafter':>10}")
        for k in sorted(methods["drafter"]["curve"], key=int):
            cells = [methods["drafter"]["curve"][k], methods.get("lookup", {}).get("curve", {}).get(k), plain]
            drafted, lookup, greedy = ("-" if value is None else f"{value:.2f}" for value in cells)
            say(f"  {k:>3} | {drafted:>7} | {lookup:>7} | {greedy:>10}")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
