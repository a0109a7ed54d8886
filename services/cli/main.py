"""``draftline``: one console script; each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from shared.errors import DraftlineError
from shared.services import SERVICE_NAMES
from shared.settings import configure_logging

log = logging.getLogger("draftline")


def _serve(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"services.{args.service}.main")
    module.main()
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from services.inference.tiny_model import make_tiny_model

    path = make_tiny_model(Path(args.dir), seed=args.seed)
    log.info("tiny target ready: %s", path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service in the foreground (what each container runs)")
    serve.add_argument("service", choices=SERVICE_NAMES)
    serve.set_defaults(func=_serve)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny Llama target (weights, tokenizer, chat template)")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DraftlineError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
