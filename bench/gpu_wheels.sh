#!/usr/bin/env bash
# Run HERE (a machine with pip's network), from the repository root, before bench/run_gpu_tests.sh goes to
# the lent GPU machine. That machine reaches no registry; its python3 has torch, transformers, tokenizers,
# safetensors, httpx, pytest, pytest-timeout, nvidia-ml-py and the rest, but not the packages below, which
# the GPU tests import (tests/conftest.py needs redis; shared/settings.py pydantic-settings; the trainer rq;
# the workers sniffio, which runtime.retry.preload_http imports).
# It downloads them as wheels for CPython 3.12 on x86-64 into .whl/ (ignored by git; name it in `carry`),
# each at the version this checkout's venv runs, so both machines test the same code against the same
# libraries where they can.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run make install first, or set PYTHON to the project venv's python" >&2; exit 1; }
PACKAGES="redis rq croniter pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection typing_extensions sniffio ${EXTRA:-}"
specs=()
for name in $PACKAGES; do
  specs+=("$name==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"
ls -1 .whl
du -sh .whl
