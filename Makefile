# Two set-up commands a new user needs: `make demo` and `make test`. Both create .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RANKS   ?= 4

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/loom demo --ranks $(RANKS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

lint: $(STAMP)
	$(BIN)/ruff check loom tests scripts

bench: $(STAMP)
	$(BIN)/loom bench latency --ranks 2 --vs raw
	$(BIN)/loom bench bw --ranks 2 --vs raw
	$(BIN)/loom bench allreduce --ranks 4 --vs raw
	$(BIN)/loom bench alltoallv --ranks 4 --vs raw

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
