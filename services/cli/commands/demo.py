"""``draftline demo``: ``make demo``'s whole pipeline as local processes (``services/cli/demo.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="the whole pipeline on a real target (SmolLM2) or the tiny one, as "
                                              "local processes")
    demo.add_argument("--data", default="./data", help="data volume for the demo (default ./data)")
    demo.add_argument("--target", default="smollm2", choices=("smollm2", "tiny"),
                      help="smollm2 (SmolLM2-135M-Instruct, the default) or tiny (the built-in test target)")
    demo.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take (default 1800)")
    demo.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from services.cli.demo import run_demo

    run_demo(Path(args.data), target=args.target, timeout_s=args.timeout)
    return 0
