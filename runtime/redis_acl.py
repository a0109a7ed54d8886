"""Redis ACL users, one per role of the stack, from passwords in the environment.

Roles (``ROLES``): ``controller`` (the controller and the CLI), ``worker`` (generator, extractor, trainer:
RQ workers and draftline's jobs) and ``exporter`` (read-only). A role gets a user only when its password
variable is set, so without any the stack runs as before: every service authenticates as Redis' ``default``
user with REDIS_PASSWORD. The ``default`` user keeps REDIS_PASSWORD and every command either way: it is the
operator's credential (redis-cli, the healthcheck) and the fallback of a role left unset; once every role
has a password, only the redis container holds it.

The rules are rendered into ``redis/roles.acl``, which ``redis/start.sh`` turns into ``redis-server --user``
directives at start-up (the redis image runs no Python); ``python -m runtime.redis_acl`` prints that file and
tests/runtime/test_redis_acl.py checks the shipped copy is what this module renders.
"""

from __future__ import annotations

import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shared.errors import SettingsError

# Commands no service of the stack sends. Wiping, reconfiguring, replicating, persisting on demand,
# debugging or stopping the server, and managing users stay with the ``default`` user (the operator).
# KEYS blocks Redis for the whole keyspace; draftline scans (SCAN) instead.
DENIED = (
    "-flushall", "-flushdb", "-config", "-debug", "-shutdown", "-module", "-acl", "-replicaof", "-slaveof",
    "-save", "-bgsave", "-bgrewriteaof", "-monitor", "-sync", "-psync", "-failover", "-cluster", "-migrate",
    "-restore", "-keys", "-swapdb", "-client|kill", "-client|pause", "-client|unpause", "-client|no-evict",
    "-latency", "-lastsave", "-slowlog|reset", "-script|flush", "-script|kill", "-function",
)
# The controller and the workers write queues, job hashes, counters and run state, run RQ's Lua scripts
# (EVALSHA, SCRIPT LOAD), read INFO for the server's version, name their connection (CLIENT SETNAME,
# CLIENT INFO) and use RQ's pub/sub command channel: everything but what DENIED takes away.
READ_WRITE = ("~*", "&*", "+@all", *DENIED)
# The exporter reads: hashes, sets, sorted sets, list lengths, SCAN; plus what a connection needs (AUTH,
# HELLO, PING, SELECT, CLIENT SETNAME) and MULTI/EXEC of redis-py's pipelines. No key, script or channel write.
READ_ONLY = ("~*", "resetchannels", "-@all", "+@read", "+@connection", "+multi", "+exec", "+discard", "+info",
             *(rule for rule in DENIED if rule in ("-keys", "-client|kill", "-client|pause", "-client|unpause",
                                                   "-client|no-evict", "-monitor")))


@dataclass(frozen=True)
class Role:
    name: str
    password_variable: str
    rules: tuple[str, ...]
    services: tuple[str, ...]


ROLES = {
    role.name: role
    for role in (
        Role("controller", "DRAFTLINE_REDIS_CONTROLLER_PASSWORD", READ_WRITE, ("controller",)),
        Role("worker", "DRAFTLINE_REDIS_WORKER_PASSWORD", READ_WRITE, ("generator", "extractor", "trainer")),
        Role("exporter", "DRAFTLINE_REDIS_EXPORTER_PASSWORD", READ_ONLY, ("exporter",)),
    )
}
# A password travels inside REDIS_URL and as one redis-server argument: URL-safe characters only.
PASSWORD_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-._~")


def role_of(service: str) -> Role | None:
    """The role a service authenticates as, or None (the inference server uses no Redis)."""
    return next((role for role in ROLES.values() if service in role.services), None)


def configured_passwords(env: Mapping[str, str]) -> dict[str, str]:
    """Role -> password, for the roles whose password variable is set and non-empty."""
    found = {}
    for role in ROLES.values():
        password = env.get(role.password_variable, "")
        if not password:
            continue
        if not set(password) <= PASSWORD_CHARACTERS:
            raise SettingsError(f"{role.password_variable} may hold only letters, digits and -._~ "
                                "(it travels inside REDIS_URL)")
        found[role.name] = password
    return found


def user_rule(role: Role, password: str) -> list[str]:
    """One ACL user as redis-server arguments after ``--user`` (also valid on an ACL SETUSER line)."""
    return [role.name, "reset", "on", f">{password}", *role.rules]


def server_arguments(env: Mapping[str, str]) -> list[str]:
    """The ``--user`` arguments of every configured role: none when no role password is set."""
    arguments: list[str] = []
    for name, password in configured_passwords(env).items():
        arguments += ["--user", *user_rule(ROLES[name], password)]
    return arguments


def render_roles_file() -> str:
    """redis/roles.acl: ``<role> <password variable> <rules…>`` per line, read by redis/start.sh."""
    lines = ["# Rendered by `python -m runtime.redis_acl > redis/roles.acl`; do not edit by hand.",
             "# <role> <password variable> <ACL rules>: redis/start.sh adds a user for each role whose",
             "# password variable is set."]
    lines += [" ".join((role.name, role.password_variable, *role.rules)) for role in ROLES.values()]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render_roles_file())


if __name__ == "__main__":
    main()
