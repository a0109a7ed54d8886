# draftline: `make demo` runs the whole pipeline on a tiny built-in target; `make test` runs the suite.
# Both create .venv on first use: torch first (a CPU build by default), then the project.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Torch goes in before the project so the project's `torch>=2.4` installs nothing more.
# For a CUDA host: make install TORCH_SPEC="torch==2.13.0" PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
DATA ?= ./data
PYTEST_ARGS ?=

.PHONY: install demo test clean-demo help

help:
	@echo "make demo   - whole pipeline on the tiny built-in target (no GPU, no Docker)"
	@echo "make test   - the test suite (needs redis-server installed)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/draftline demo --data $(DATA)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean-demo:
	rm -rf $(DATA)/runs/demo-* $(DATA)/logs
