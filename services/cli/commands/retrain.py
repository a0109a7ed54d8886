"""``draftline retrain SOURCE --name NEW``: train again on a finished run's capture with other training settings
(services/controller/runs/retrain.py), tracked like any run."""

from __future__ import annotations

import argparse
import sys

from services.cli.commands.common import controller_settings
from shared.lifecycle import Stage
from shared.runspec import RETRAIN_SECTIONS


def register(subparsers: argparse._SubParsersAction) -> None:
    retrain = subparsers.add_parser("retrain", help="a new run training on a finished run's replies and hidden states "
                                                    "(linked, not copied) with other train or evaluate settings")
    retrain.add_argument("source", help="the run whose capture to train on (generation and extraction settled)")
    retrain.add_argument("--name", required=True, help="the new run's name")
    retrain.add_argument("--epochs", type=int)
    retrain.add_argument("--lr", type=float)
    retrain.add_argument("--ttt-steps", type=int, help="training-time-test unroll length")
    retrain.add_argument("--draft-vocab-size", type=int)
    retrain.add_argument("--base-checkpoint", help="published drafter to fine-tune (repo id or path)")
    retrain.add_argument("--online", action="store_true", default=None,
                         help="train online: the states extracted again from the capture's replies as training asks "
                              "for them, within --online-budget (README: online runs)")
    retrain.add_argument("--online-budget", type=int, metavar="BYTES",
                         help="most bytes of hidden states on the volume at once (default: a quarter of the free space)")
    retrain.add_argument("--run-config", metavar="FILE",
                         help="a JSON object of train, evaluate and online sections; the flags above override its values")
    retrain.add_argument("--controller", metavar="URL",
                         help="ask this controller's API (POST /runs/SOURCE/retrain), sending DRAFTLINE_API_TOKEN, "
                              "instead of the volume and Redis directly")
    retrain.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from services.cli.commands.run import run_config
    from services.controller.loop.reconcile import reconcile_run
    from services.controller.runs.retrain import retrain_run
    from runtime.queues import connect

    settings = controller_settings()
    sections = run_config(args.run_config)
    flags = {"epochs": args.epochs, "lr": args.lr, "ttt_steps": args.ttt_steps,
             "draft_vocab_size": args.draft_vocab_size, "base_checkpoint": args.base_checkpoint}
    train = {**sections.get(Stage.TRAIN, {}), **{k: v for k, v in flags.items() if v is not None}}
    if train:
        sections[Stage.TRAIN] = train
    online = {**sections.get("online", {}), **({"enabled": True} if args.online or args.online_budget else {}),
              **({"budget_bytes": args.online_budget} if args.online_budget is not None else {})}
    if online:
        sections["online"] = online
    if args.controller:
        return _through_api(args, sections, settings)
    conn = connect(settings.redis_url)
    # Registered now rather than at the controller's next pass, so `draftline status` shows it at once.
    spec, report = retrain_run(settings.data, conn, args.source, args.name, sections, register=reconcile_run)
    changed = ", ".join(f"{part}.{k}={v}" for part in RETRAIN_SECTIONS for k, v in sections.get(part, {}).items())
    taken = (f"{report.generated:,} replies of {report.expected:,} samples from {args.source}'s capture (hard links; "
             "the states are extracted again as online training asks for them)" if spec.online.enabled else
             f"{report.extracted:,} of {report.expected:,} samples from {args.source}'s capture (hard links, no bytes "
             "copied)")
    sys.stdout.write(f"run {spec.name}: {taken}, {report.failures_kept:,} failures kept; changed "
                     f"{changed or 'nothing'}; the controller enqueues its training next "
                     f"(draftline status {spec.name})\n")
    return 0


def _through_api(args: argparse.Namespace, sections: dict, settings) -> int:
    """The same retrain through ``POST /runs/<source>/retrain``, with the API token."""
    from services.cli.api import ControllerClient

    token = settings.api_token
    with ControllerClient(args.controller, token=token.get_secret_value() if token else None) as client:
        spec = client.retrain(args.source, {"name": args.name, **sections})
    sys.stdout.write(f"run {spec['name']}: laid from {args.source}'s capture through {args.controller}; the "
                     f"controller enqueues its training next (draftline status {spec['name']})\n")
    return 0
