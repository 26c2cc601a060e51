# Two commands matter: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := demo

.PHONY: demo test install lint bench clean

install: $(VENV)/.installed

# torch first, pinned: it takes the local CPU wheel instead of a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(BIN)/rein make-tiny-model $(DEMO)/tiny-llama --arch llama
	$(BIN)/rein run-batch examples/batch.jsonl -o $(DEMO)/batch-output.jsonl --model $(DEMO)/tiny-llama
	@echo "--- first output line:"; head -n 1 $(DEMO)/batch-output.jsonl
	@echo "--- streamed generation:"
	$(BIN)/rein generate --model $(DEMO)/tiny-llama --chat --max-tokens 48 --temperature 0.8 --seed 1 \
		"Write a Python function that adds two numbers."

test: install
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check rein tests bench

bench: install
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(DEMO) .pytest_cache
