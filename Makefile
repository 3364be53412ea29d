# Two commands for a fresh machine with only Python: `make demo` and `make test`.
# Both create .venv when it is missing and install what they need.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch 2.13.0: its CPU wheel is on this machine's disk; any other spec downloads GBs of CUDA.
TORCH_SPEC ?= torch==2.13.0
# Azurite (Azure Blob stand-in) comes from npm; installed only where npm exists.
AZURITE_VERSION := 3.37.0
AZURITE := .tools/node_modules/.bin/azurite-blob

.PHONY: setup demo test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(AZURITE):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .tools azurite@$(AZURITE_VERSION); \
	else \
		echo "npm not found: Azure (Azurite) tests will be skipped"; \
	fi

demo: setup
	$(VENV)/bin/diloco bench store --store file://$(CURDIR)/.diloco/bench

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

format: setup
	$(VENV)/bin/ruff check --fix src tests
	$(VENV)/bin/ruff format src tests

test: lint $(AZURITE)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .tools .diloco .pytest_cache .ruff_cache .hypothesis
