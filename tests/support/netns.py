"""Several "hosts" on one machine for a test: Linux network namespaces joined by a veth pair, each with its
own address, made by the test and removed after it (iproute2's ``ip``; root).

Traffic between the hosts goes over the veth pair only; nothing is routed out of the machine. The hosts
share the filesystem, as hosts of one cluster share the volume (NFS or a parallel file system).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces for the test (not root, or no iproute2)."""


@dataclass(frozen=True)
class Host:
    name: str | None  # the namespace; None: this machine's own
    addr: str  # its address on the pair
    ifname: str  # its end of the pair (GLOO_SOCKET_IFNAME)

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run on this host."""
        return list(command) if self.name is None else ["ip", "netns", "exec", self.name, *command]

    def popen(self, command: Sequence[str], log_path: Path, env: Mapping[str, str]) -> subprocess.Popen:
        """Start ``command`` on this host in a session of its own (so ``kill_group`` ends all of it)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            return subprocess.Popen(self.argv(command), stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                                    start_new_session=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _check_can_make_namespaces() -> None:
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("no `ip` command: install iproute2")
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root")


def _bring_up(host: Host) -> None:
    """A namespaced host's loopback and its end of a pair, with its address."""
    _ip("-n", host.name, "link", "set", "lo", "up")
    _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
    _ip("-n", host.name, "link", "set", host.ifname, "up")


@contextmanager
def two_hosts(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Two namespaced hosts, 10.250.N.1 and 10.250.N.2 (N from the process id, so parallel tests differ)."""
    _check_can_make_namespaces()
    tag = tag or f"dl{os.getpid() % 100000}"
    subnet = f"10.250.{os.getpid() % 250}"
    hosts = (Host(f"{tag}a", f"{subnet}.1", f"{tag}va"), Host(f"{tag}b", f"{subnet}.2", f"{tag}vb"))
    made: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.name)
            made.append(host.name)
        _ip("link", "add", hosts[0].ifname, "netns", hosts[0].name, "type", "veth", "peer", "name", hosts[1].ifname,
            "netns", hosts[1].name)
        for host in hosts:
            _bring_up(host)
        yield hosts
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes its end of the pair along


@contextmanager
def host_beside_this_machine(tag: str, subnet: int) -> Iterator[tuple[Host, Host]]:
    """This machine (its own namespace, 10.251.``subnet``.1) and one namespaced host (.2), which the test itself
    reaches, as the first host of a cluster would. This machine's address sits on a bridge, as a host's address
    sits on its network card: ``cut`` pulls the other host's cable without taking that address along."""
    _check_can_make_namespaces()
    here, there = Host(None, f"10.251.{subnet}.1", f"{tag}br"), Host(tag, f"10.251.{subnet}.2", f"{tag}v")
    made: list[list[str]] = []
    try:
        _ip("link", "add", here.ifname, "type", "bridge")
        made.append(["link", "del", here.ifname])
        _ip("addr", "add", f"{here.addr}/24", "dev", here.ifname)
        _ip("link", "set", here.ifname, "up")
        _ip("netns", "add", there.name)
        made.append(["netns", "del", there.name])
        _ip("link", "add", f"{tag}h", "type", "veth", "peer", "name", there.ifname, "netns", there.name)
        _ip("link", "set", f"{tag}h", "master", here.ifname, "up")
        _bring_up(there)
        yield here, there
    finally:
        for args in reversed(made):  # the namespace takes its pair along
            subprocess.run(["ip", *args], capture_output=True)


def cut(there: Host) -> None:
    """Delete ``there``'s cable (its veth pair): from now on its packets go nowhere and nothing of it reaches
    the others, and no socket on either side is told."""
    _ip("-n", there.name, "link", "del", there.ifname)


def kill_group(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGKILL ``proc``'s session (it was started with one of its own) and reap it."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def wait_for_line(path: Path, text: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``text`` appears in the log at ``path``; fails with the log's tail when it does not (or ``proc`` ends)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = path.read_text(errors="replace")[-3000:] if path.is_file() else "(no log)"
    raise AssertionError(f"{text!r} not in {path} within {timeout_s:.0f}s:\n{tail}")
