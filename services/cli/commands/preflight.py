"""``draftline preflight``: the checks a run would face; the work is the controller's
(``services/controller/api/preflight_command.py``)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    preflight = subparsers.add_parser("preflight", help="check Redis, the inference server, the volume, disk, GPU, "
                                                        "checkpoint")
    preflight.add_argument("--run-config", help="a JSON body as POST /runs takes, to check a planned run too")
    preflight.add_argument("--force", action="store_true", help="report as a forced run would be judged")
    preflight.add_argument("--json", action="store_true")
    preflight.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from services.controller.api.preflight_command import preflight_main

    return preflight_main(args)
