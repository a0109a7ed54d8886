"""``draftline preflight``: the checks a run would face, from a ``POST /runs`` body in a file.

It sits above both the API's request model and the run's start (its ``draft_spec``), which preflight itself
never imports: the checks are domain code, reading a request body is the command's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.controller.runs.preflight import format_preflight, run_preflight
from services.controller.api.routes.runs import SubmitRequest
from services.controller.runs.served import served_model
from services.controller.runs.start import draft_spec
from shared.errors import DraftlineError, InferenceUnavailable
from shared.runspec import RunSpec
from shared.settings import ControllerSettings, load_settings


def spec_from_request(settings: ControllerSettings, body: dict) -> RunSpec:
    """The RunSpec a ``POST /runs`` body would create, built without reading the dataset. Without a model
    name and without an answering server the model stays empty; the inference check then names the server."""
    body = SubmitRequest.model_validate(body)
    try:
        model = body.model or served_model(settings.inference_url)
    except InferenceUnavailable:
        model = ""
    return draft_spec(settings, body.run_request(model))


def preflight_main(args: argparse.Namespace) -> int:
    """``draftline preflight [--run-config FILE] [--force] [--json]``: 0 when a run may start, 1 when not."""
    settings = load_settings(ControllerSettings)
    spec = None
    if getattr(args, "run_config", None):
        try:
            body = json.loads(Path(args.run_config).read_text(encoding="utf-8"))
            spec = spec_from_request(settings, body)
        except (OSError, ValueError) as exc:
            raise PreflightConfigError(f"run config {args.run_config}: {exc}") from None
    report = run_preflight(settings, spec=spec, force=bool(getattr(args, "force", False)))
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(format_preflight(report) + "\n")
    return 0 if report.allowed else 1


class PreflightConfigError(DraftlineError):
    """The run configuration given to ``draftline preflight`` cannot be read."""
