#!/usr/bin/env bash
# The GPU tests (tests/gpu, marked `gpu`) on a CUDA machine, e.g. the lent H200, with one command:
#   bash bench/run_gpu_tests.sh            (after bench/gpu_wheels.sh here; the device call carries .whl)
# It uses that machine's python3 (its CUDA torch, transformers, pytest) plus the wheels in .whl/, builds
# the tiny target into a fresh cache (no cache travels: the key hashes the library versions), fails rather
# than skips where no CUDA device is visible, and writes the log, a JUnit XML and the versions to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-test-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/draftline-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/draftline-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DRAFTLINE_REQUIRE_GPU=1
export DRAFTLINE_TEST_CACHE=${DRAFTLINE_TEST_CACHE:-/tmp/draftline-test-cache}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi failed"
  "$PY" - <<'PY'
import importlib.metadata as m
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
for name in ("transformers", "tokenizers", "safetensors", "nvidia-ml-py", "pytest", "pydantic", "redis"):
    print(name, m.version(name))
PY
} 2>&1 | tee "$OUT/gpu-env.txt"
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml" 2>&1 | tee "$OUT/gpu-tests.log"
exit "${PIPESTATUS[0]}"
