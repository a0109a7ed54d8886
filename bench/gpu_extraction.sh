#!/usr/bin/env bash
# Extraction speed on the lent GPU at Llama-3.1-8B's shape: bench/bench_hidden_states.py on a random 8B target over a
# mix of 512-4,096-token samples, bf16 files then fp8 files, each against the best plain forward and the disk's
# fsync'd rate measured in the same run. Run after `bash bench/gpu_pipeline.sh stage` (its installed stack), or with
# PYTHONPATH naming one. One JSON line per storage goes to $OUT/extraction-<storage>.json.
#   bash bench/gpu_extraction.sh [SAMPLES] [LENGTHS]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-extraction-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SAMPLES=${1:-144}
LENGTHS=${2:-512,1024,1536,2048,3072,4096}
export PYTHONPATH="$PWD:${PYTHONPATH:-/tmp/draftline-bench/site}" PYTHONUNBUFFERED=1
MODEL=/tmp/llama8b-random
[ -f "$MODEL/config.json" ] || "$PY" bench/make_random_target.py "$MODEL" --layers 32 > "$OUT/make-target.log" 2>&1 \
  || { tail -20 "$OUT/make-target.log"; exit 1; }
status=0
for storage in target fp8; do
  "$PY" bench/bench_hidden_states.py --model-dir "$MODEL" --lengths "$LENGTHS" --samples "$SAMPLES" --storage "$storage" \
    --out "/tmp/bench-hidden-$storage" --disk-mb 4096 > "$OUT/extraction-$storage.log" 2>&1 || status=1
  grep '^{' "$OUT/extraction-$storage.log" | tee "$OUT/extraction-$storage.json"
  [ -s "$OUT/extraction-$storage.json" ] || tail -20 "$OUT/extraction-$storage.log"
  rm -rf "/tmp/bench-hidden-$storage"
done
exit $status
