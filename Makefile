# The two commands a newcomer needs: `make demo` and `make test`. Both set up what is missing.
VENV ?= .venv
BIN := $(VENV)/bin
TEST_MODEL ?= smollm2-135m-instruct
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup models demo test test-fast bench lint

setup:
	@bash infra/setup.sh

models: setup
	$(BIN)/memstream models pull $(TEST_MODEL)

demo: setup
	$(BIN)/memstream demo

test: setup models
	bash infra/services/postgres.sh install
	$(BIN)/pytest -q -ra

test-fast: setup
	$(BIN)/pytest -q -m "not engine and not server"

bench: setup models
	$(BIN)/python bench/run.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
