#!/usr/bin/env bash
# The Debian packages that `make demo` and `make test` run as programs, checked by the commands they
# install. As root the missing ones are installed with apt-get; otherwise one line names them and the
# script fails, so nothing later skips or errors for a package this script could have installed.
#
# usage: tools/system-packages.sh [PACKAGE...]   (default: redis-server prometheus chromium)
#   redis-server  the suite's private Redis, and the demo's when none answers on 127.0.0.1:6379
#   prometheus    promtool (config and rule checks) and the server (the live-Prometheus test)
#   chromium      the status page rendered headless
set -euo pipefail

# Debian's invoke-rc.d asks this file whether a package's postinst may start its daemon; tests point
# it elsewhere so they never write to /usr/sbin.
POLICY_RC_D=${POLICY_RC_D:-/usr/sbin/policy-rc.d}

KNOWN=(redis-server prometheus chromium)

installed() {
  case "$1" in
    redis-server) command -v redis-server ;;
    prometheus) command -v prometheus && command -v promtool ;;
    chromium) command -v chromium || command -v chromium-browser ;;
  esac >/dev/null
}

missing_of() {
  local package
  for package in "$@"; do
    installed "$package" || printf '%s\n' "$package"
  done
}

# Debian's postinst scripts would start the daemons (redis-server, prometheus); the tests and the demo
# start their own on free ports. A policy-rc.d that exits 101 forbids it; one already there is kept.
apt_install() {
  local own_policy=0
  export DEBIAN_FRONTEND=noninteractive
  if [ ! -e "$POLICY_RC_D" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$POLICY_RC_D"
    chmod +x "$POLICY_RC_D"
    own_policy=1
  fi
  local status=0
  { apt-get update -q && apt-get install -y -q --no-install-recommends "$@"; } || status=$?
  if [ "$own_policy" = 1 ]; then rm -f "$POLICY_RC_D"; fi
  return "$status"
}

main() {
  local wanted=("$@") package
  [ "${#wanted[@]}" -gt 0 ] || wanted=("${KNOWN[@]}")
  for package in "${wanted[@]}"; do
    case " ${KNOWN[*]} " in
      *" $package "*) ;;
      *) echo "$0: unknown package '$package' (known: ${KNOWN[*]})" >&2; return 2 ;;
    esac
  done
  local missing
  mapfile -t missing < <(missing_of "${wanted[@]}")
  [ "${#missing[@]}" -gt 0 ] || return 0
  if [ "$EUID" -ne 0 ]; then
    echo "missing system packages: ${missing[*]}; install them as root: sudo $0 ${missing[*]} (or apt-get install --no-install-recommends ${missing[*]})" >&2
    return 1
  fi
  if ! command -v apt-get >/dev/null; then
    echo "missing system packages: ${missing[*]}; no apt-get on this machine: install them with its package manager" >&2
    return 1
  fi
  apt_install "${missing[@]}"
  mapfile -t missing < <(missing_of "${missing[@]}")
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "apt-get installed the packages but these are still missing their commands: ${missing[*]}" >&2
    return 1
  fi
}

main "$@"
