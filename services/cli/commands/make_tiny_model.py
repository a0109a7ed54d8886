"""``draftline make-tiny-model DIR``: the tiny built-in target (``services/cli/tiny_model.py``) written to DIR."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

# The command's own line is the CLI's, as ``draftline: ...`` (main's logger), not the module's.
log = logging.getLogger("draftline")


def register(subparsers: argparse._SubParsersAction) -> None:
    tiny = subparsers.add_parser("make-tiny-model",
                                 help="write a tiny Llama target (weights, tokenizer, chat template)")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from services.cli.tiny_model import make_tiny_model

    path = make_tiny_model(Path(args.dir), seed=args.seed)
    log.info("tiny target ready: %s", path)
    return 0
