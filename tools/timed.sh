#!/usr/bin/env bash
# Runs one set-up step of `make test` and says how long it took, so a slow set-up is seen, not guessed.
#
# usage: tools/timed.sh STEP COMMAND [ARG...]
#   prints "make test set-up: STEP took N s" (or "failed after N s") on stderr; exits as COMMAND exits
set -uo pipefail
step=$1
shift
start=$(date +%s)
"$@"
status=$?
took=$(( $(date +%s) - start ))
if [ "$status" -eq 0 ]; then
  printf 'make test set-up: %s took %d s\n' "$step" "$took" >&2
else
  printf 'make test set-up: %s failed after %d s (exit %d)\n' "$step" "$took" "$status" >&2
fi
exit "$status"
