#!/usr/bin/env bash
# The trainer on one GPU at Llama-3.1-8B drafter shapes, with one command (the lent H200, carrying .whl):
#   bash bench/gpu_trainer.sh [LENGTHS] [ATTENTION] [PRECISION]   defaults: "2048 4096", "dense,flex" and "fp32"
# For each length: bench/bench_train_ddp.py, batch 1, one process, each attention kind (train.attention), the
# last 3 steps of each run profiled (left out of the timing). Then the trainer's GPU tests. Results, profiles
# and logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-trainer-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LENGTHS=${1:-2048 4096}
ATTENTION=${2:-dense,flex}
PRECISION=${3:-fp32}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/draftline-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/draftline-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu-env.txt" 2>&1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu-env.txt" 2>&1
status=0
for length in $LENGTHS; do
  "$PY" bench/bench_train_ddp.py --work "/tmp/bench-train-$length" --procs 1 --batch-sizes 1 --length "$length" \
    --steps 23 --warmup 5 --attention "$ATTENTION" --precision "$PRECISION" --profile-steps 3 --profile-dir "$OUT/profiles-$length" \
    --out "$OUT/train-$length.json" > "$OUT/train-$length.log" 2>&1 || status=1
  grep '^{' "$OUT/train-$length.log"
  rm -rf "/tmp/bench-train-$length"
done
if [ "${GPU_TESTS:-1}" = 1 ]; then
  DRAFTLINE_REQUIRE_GPU=1 DRAFTLINE_TEST_CACHE=/tmp/draftline-test-cache "$PY" -m pytest -q -m gpu tests/gpu/test_trainer_cuda.py \
    -p no:cacheprovider > "$OUT/gpu-trainer-tests.log" 2>&1 || status=1
  tail -5 "$OUT/gpu-trainer-tests.log"
fi
exit $status
