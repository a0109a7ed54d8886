"""``draftline worker-health ROLE``: the worker containers' health check."""

from __future__ import annotations

import argparse
import sys

from shared.services import WORKER_ROLES


def register(subparsers: argparse._SubParsersAction) -> None:
    health = subparsers.add_parser("worker-health", help="exit 0 when this host's worker of ROLE is registered in "
                                                         "Redis (the worker containers' health check)")
    health.add_argument("role", choices=WORKER_ROLES)
    health.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    """``draftline worker-health ROLE``: 0 when a ROLE worker of this host (container) is registered in
    Redis, 1 with the reason otherwise; the compose files' health check for the worker services."""
    import socket

    import redis

    from runtime.queues import connect
    from shared.settings import CommonSettings, load_settings
    from runtime.worker import registered_workers

    host = socket.gethostname()
    # Only Redis is needed: a role's full settings would also check what its jobs need, not its health.
    settings = load_settings(CommonSettings)
    try:
        names = registered_workers(connect(settings.redis_url), args.role, host)
    except redis.RedisError as exc:
        sys.stderr.write(f"{args.role} on {host}: Redis does not answer: {exc}\n")
        return 1
    if not names:
        sys.stderr.write(f"{args.role} on {host}: no worker registered in Redis (starting, or stopped)\n")
        return 1
    sys.stdout.write(f"{args.role} on {host}: {', '.join(names)} registered\n")
    return 0
