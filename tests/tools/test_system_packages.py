"""tools/system-packages.sh against a PATH of stubs: which packages count as missing, the one line a
non-root user gets, and what a root run asks apt-get for (a stub apt-get that records its calls; the
real one never runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import REPO

SCRIPT = REPO / "tools" / "system-packages.sh"
ALL = ("redis-server", "prometheus", "chromium")
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="installing takes root; this test runs as a user")

# Records each call, whether policy-rc.d forbade daemon starts during the install, and "installs" each
# package by creating its commands (unless STUB_INSTALLS_NOTHING is set).
APT_GET = """#!/bin/bash
echo "$*" >> "$APT_LOG"
if [ "$1" = install ]; then
  "$POLICY_RC_D" >/dev/null 2>&1; echo "policy-rc.d=$? frontend=$DEBIAN_FRONTEND" >> "$APT_LOG"
  [ -n "$STUB_INSTALLS_NOTHING" ] && exit 0
  for package in "$@"; do
    case "$package" in
      redis-server) commands=(redis-server) ;;
      prometheus) commands=(prometheus promtool) ;;
      chromium) commands=(chromium) ;;
      *) continue ;;
    esac
    for command in "${commands[@]}"; do printf '#!/bin/sh\\n' > "$STUB_DIR/$command"; chmod +x "$STUB_DIR/$command"; done
  done
fi
"""


@pytest.fixture()
def world() -> Iterator[Path]:
    """A directory the unprivileged user can read too: pytest's own temp root is private to its user."""
    with tempfile.TemporaryDirectory(prefix="system-packages-") as name:
        path = Path(name)
        path.chmod(0o755)
        shutil.copy(SCRIPT, path / "system-packages.sh")
        (path / "bin").mkdir(mode=0o755)
        yield path


def stub(world: Path, *commands: str) -> None:
    for command in commands:
        target = world / "bin" / command
        target.write_text("#!/bin/sh\n")
        target.chmod(0o755)


def with_apt_get(world: Path) -> None:
    (world / "bin" / "apt-get").write_text(APT_GET)
    (world / "bin" / "apt-get").chmod(0o755)
    for tool in ("chmod", "rm"):  # what the script and the stub run besides bash builtins
        (world / "bin" / tool).symlink_to(shutil.which(tool))


def run(world: Path, *packages: str, as_root: bool, **env: str) -> subprocess.CompletedProcess:
    command = ["/bin/bash", str(world / "system-packages.sh"), *packages]
    if not as_root and os.geteuid() == 0:
        command = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]
    environment = {"PATH": str(world / "bin"), "POLICY_RC_D": str(world / "policy-rc.d"),
                   "APT_LOG": str(world / "apt.log"), "STUB_DIR": str(world / "bin"), **env}
    return subprocess.run(command, check=False, env=environment, capture_output=True, text=True, timeout=60)


def apt_calls(world: Path) -> list[str]:
    log = world / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_nothing_missing_is_a_silent_success(world):
    stub(world, "redis-server", "prometheus", "promtool", "chromium")
    result = run(world, as_root=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_a_user_gets_one_line_naming_exactly_the_missing_packages_and_a_failure(world):
    stub(world, "prometheus", "promtool")
    with_apt_get(world)
    result = run(world, as_root=False)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("missing system packages: redis-server chromium;")
    assert "apt-get install --no-install-recommends redis-server chromium" in lines[0]
    assert apt_calls(world) == []


def test_prometheus_counts_as_missing_without_its_server_binary(world):
    stub(world, "redis-server", "promtool", "chromium")
    result = run(world, as_root=False)
    assert result.returncode == 1 and result.stderr.startswith("missing system packages: prometheus;")


def test_ubuntus_chromium_browser_counts_as_chromium(world):
    stub(world, "chromium-browser")
    assert run(world, "chromium", as_root=False).returncode == 0


def test_only_the_packages_named_are_checked(world):
    stub(world, "redis-server")
    assert run(world, "redis-server", as_root=False).returncode == 0  # what `make demo` asks for


def test_an_unknown_package_is_refused_by_name(world):
    result = run(world, "redis", as_root=False)
    assert result.returncode == 2 and "unknown package 'redis'" in result.stderr


@needs_root
def test_root_updates_then_installs_only_the_missing_packages_with_daemon_starts_forbidden(world):
    stub(world, "redis-server")
    with_apt_get(world)
    result = run(world, as_root=True)
    assert result.returncode == 0, result.stderr
    assert apt_calls(world) == ["update -q", "install -y -q --no-install-recommends prometheus chromium",
                                "policy-rc.d=101 frontend=noninteractive"]
    assert not (world / "policy-rc.d").exists()  # removed again: later installs may start daemons


@needs_root
def test_root_keeps_a_policy_rc_d_it_did_not_write(world):
    with_apt_get(world)
    (world / "policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (world / "policy-rc.d").chmod(0o755)
    assert run(world, "redis-server", as_root=True).returncode == 0
    assert (world / "policy-rc.d").read_text() == "#!/bin/sh\nexit 101\n"


@needs_root
def test_root_fails_when_apt_get_leaves_a_command_missing(world):
    with_apt_get(world)
    result = run(world, "redis-server", as_root=True, STUB_INSTALLS_NOTHING="1")
    assert result.returncode == 1 and "still missing their commands: redis-server" in result.stderr
    assert not (world / "policy-rc.d").exists()


@needs_root
def test_root_without_apt_get_names_the_packages_and_fails(world):
    result = run(world, "chromium", as_root=True)
    assert result.returncode == 1 and "missing system packages: chromium; no apt-get" in result.stderr


def dry_run(target: str) -> list[str]:
    """The commands a plain ``make TARGET`` would run. Under ``make test`` itself this would be a sub-make,
    with the outer make's variables (PYTEST_ARGS, say) and "Entering directory" lines: neither is wanted."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "PYTEST_ARGS")}
    return subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO, env=env, capture_output=True,
                          text=True, check=True).stdout.splitlines()


def test_make_test_and_ci_run_the_script_for_every_package_before_the_suite():
    # `make test` runs each set-up step as a timed sub-make (tools/timed.sh); -n prints the sub-makes' commands.
    dry = [line for line in dry_run("test") if not line.startswith(("bash tools/timed.sh", "make"))]
    setup = f"bash tools/system-packages.sh {' '.join(ALL)}"
    assert dry[0] == setup and " -m pytest " in dry[-1]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.index(setup) < ci.index("make test")
    assert "apt-get" not in "\n".join(ci)  # one copy of the install logic


def test_make_demo_installs_redis_server_before_the_demo():
    dry = dry_run("demo")
    assert dry[0] == "bash tools/system-packages.sh redis-server"
