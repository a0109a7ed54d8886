"""Training across hosts: the train job's host announces each multi-node training, every other trainer node
joins it, and torchrun's own c10d rendezvous brings the ranks together.

Every node runs ``torch.distributed.run`` with the same ``--rdzv-id``, ``--rdzv-endpoint`` and ``--nnodes``.
The train job's host hosts the rendezvous store at the endpoint (``is_host=1``: it does not guess from host
names); training starts once all nodes have joined, within ``DRAFTLINE_TRAIN_TIMEOUT_S``, or fails by name.
The job announces each training in Redis (``ANNOUNCE_KEY``: the run, the rendezvous id, endpoint and node
count) and withdraws it when the training ends; a node started as ``DRAFTLINE_TRAIN_NODE=join draftline serve
trainer`` polls for it and joins each new one, so a second host joins with that one command.

Ranks on every node write their logs and failures to the run's folder on the shared volume
(``rank_dir``), so the job names the first failure of any node's rank, not only its own.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from shared.errors import DraftlineError
from shared.layout import RunPaths

log = logging.getLogger(__name__)

ANNOUNCE_KEY = "draftline:train:rendezvous"  # the training nodes should join now, as JSON; absent: none
POLL_S = 1.0  # how often a joining node looks for a training to join


class RendezvousUnreachable(DraftlineError):
    """A node cannot reach, or cannot host, the rendezvous endpoint it was given."""


@dataclass(frozen=True)
class Rendezvous:
    """One multi-node training: which run, its rendezvous id (new for every attempt, so a retry never meets
    the state of a failed one), where the train job's host listens, and how many nodes train."""

    run: str
    id: str
    endpoint: str
    nodes: int

    @classmethod
    def new(cls, run: str, endpoint: str, nodes: int) -> Rendezvous:
        return cls(run=run, id=f"{run}-{uuid.uuid4().hex[:12]}", endpoint=endpoint, nodes=nodes)

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise RendezvousUnreachable(f"rendezvous endpoint {self.endpoint!r} is not host:port")
        return host.strip("[]"), int(port)


def rank_dir(data: Path, rendezvous: Rendezvous) -> Path:
    """Where the ranks of every node write their logs and failures: the run's folder on the shared volume."""
    return RunPaths(data, rendezvous.run).root / "train-ranks" / rendezvous.id


def torchrun_args(rendezvous: Rendezvous, *, host: bool, timeout_s: float, local_addr: str | None) -> list[str]:
    """torchrun's arguments for one node of ``rendezvous`` (instead of ``--standalone``). No restarts: a failed
    rank fails the training, and the job's retry starts a new rendezvous from the last checkpoint."""
    conf = f"join_timeout={max(1, round(timeout_s))},is_host={int(host)}"
    return [f"--nnodes={rendezvous.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous.endpoint}",
            f"--rdzv-id={rendezvous.id}", f"--rdzv-conf={conf}", "--max-restarts=0",
            *([f"--local-addr={local_addr}"] if local_addr else [])]


def check_hostable(rendezvous: Rendezvous) -> None:
    """The train job's host must be able to listen on the endpoint's address: checked before any rank starts,
    so a wrong address is one clear error instead of torchrun's traceback."""
    host, port = rendezvous.host_port()
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise RendezvousUnreachable(
            f"DRAFTLINE_TRAIN_RDZV_ENDPOINT={rendezvous.endpoint}: this host (the train job's) cannot listen there "
            f"({exc.strerror or exc}); it must be an address of this host that every node reaches") from None


def check_reachable(rendezvous: Rendezvous, timeout_s: float) -> None:
    """A joining node must reach the endpoint: checked before torchrun, which would otherwise wait out its
    join timeout and fail with a traceback."""
    host, port = rendezvous.host_port()
    end = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as exc:
            if time.monotonic() >= end:
                raise RendezvousUnreachable(f"rendezvous endpoint {rendezvous.endpoint} of run {rendezvous.run} "
                                            f"unreachable from this node after {timeout_s:.0f}s: {exc}") from None
            time.sleep(0.5)


def announce(conn: redis.Redis, rendezvous: Rendezvous) -> None:
    conn.set(ANNOUNCE_KEY, json.dumps(asdict(rendezvous)))


def withdraw(conn: redis.Redis, rendezvous: Rendezvous) -> None:
    """Withdraw ``rendezvous`` if it is still the one announced (a later training's announcement stays)."""
    raw = conn.get(ANNOUNCE_KEY)
    if raw is not None and json.loads(raw).get("id") == rendezvous.id:
        conn.delete(ANNOUNCE_KEY)


def announced(conn: redis.Redis) -> Rendezvous | None:
    raw = conn.get(ANNOUNCE_KEY)
    if raw is None:
        return None
    try:
        return Rendezvous(**json.loads(raw))
    except (TypeError, ValueError):
        log.error("%s holds %r, not a rendezvous; ignored", ANNOUNCE_KEY, raw[:200])
        return None
