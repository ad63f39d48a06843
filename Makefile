# The two commands a new user runs (see README.md):
#   make demo   corpus extraction on the bundled demo (embedded Redis, stand-in models)
#   make test   ruff, mypy and the whole test suite
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.voxmill-installed
DEMO_DIR ?= demo

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,monitor]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/voxmill demo --dir $(DEMO_DIR)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two test processes (pytest-xdist): many tests wait on processes, timeouts and outages, so the
# suite takes 8-10 min on 2 cores instead of 17. worksteal hands each process half of the tests in
# file order and lets an idle one take the other's remaining tests; loadfile kept whole files
# together and left one process idle for up to 2 min at the end.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist worksteal

test: lint
	$(PYTEST)

# Skips the slow fault and soak tests (CI runs them all).
test-fast: lint
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) $(DEMO_DIR) .mypy_cache .ruff_cache .pytest_cache
