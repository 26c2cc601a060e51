# Two commands matter: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := demo

.PHONY: demo test check test-fallback install lint bench clean

install: $(VENV)/.installed

# torch first, pinned: it takes the local CPU wheel instead of a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: install
	BIN=$(BIN) DEMO=$(DEMO) bash examples/demo.sh

# Every tier CI runs, a worker per core (pytest-xdist): a file's tests stay together, the
# real-model tier on one worker (tests/conftest.py); each test's tier is a marker (-m unit).
test: install
	$(BIN)/pytest -q -n auto --dist loadgroup

# The inner loop: the tiers that need no services (unit, kernels), on every core.
check: install
	$(BIN)/pytest -q -n auto tests/unit tests/kernels

# The tests a CPU fast path can change (FAST_PATH_FILES in tests/support.py) on torch's
# code alone, as on a CPU that runs none of rein's fast paths.
test-fallback: install
	REIN_CPU_FAST_PATHS=0 $(BIN)/pytest -q -n auto --dist loadgroup -m fast_path tests/unit tests/kernels tests/real

# compose.yaml for real: local images, an offline image build, SmolLM2 answering, a batch
# across a worker restart (tests/deploy/run.sh; needs root or sudo for docker and apt).
.PHONY: test-deploy
test-deploy: install
	bash tests/deploy/run.sh

lint: install
	$(BIN)/ruff check rein tests bench

bench: install
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(DEMO) .pytest_cache
