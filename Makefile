# `make test` and `make demo` each create or reuse .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned for this platform's CPU build; a bare `torch` pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.dsat-installed-test
DEV_STAMP := $(VENV)/.dsat-installed-dev

.PHONY: test lint demo demo-simulated bench venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test,report]"
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(DEV_STAMP)

venv: $(STAMP)

# The search's and the simulator's tests are pure Python and start no process: they run on every
# core at once. The rest start real DeepSpeed trials and are timed (trial timeouts, stop signals):
# two files at a time, each whole in one pytest worker, with a slot-claim directory of its own
# (tests/conftest.py). One at a time they left a 2-core machine's second core mostly idle.
PARALLEL_TESTS := tests/search tests/runners/simulated

test: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest -n auto --durations=5 $(PARALLEL_TESTS)
	DS_ACCELERATOR=cpu $(PY) -m pytest -n 2 --dist loadfile --durations=20 $(addprefix --ignore=,$(PARALLEL_TESTS))

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check dsat tests examples benchmarks
	$(VENV)/bin/ruff format --check dsat tests examples benchmarks
	$(VENV)/bin/mypy

# The main job: a real local guided autotune of the CPU example, 2 trials at a time (about 20 s on
# 2 cores). On a CPU the memory model sees all of RAM; --search-range-factor keeps micro-batches
# small enough for quick trials. DEMO_ARGS adds flags (the benchmarks pass --results-dir).
demo: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -m dsat guided examples/core_api_mlp/deepspeed.yaml examples/core_api_mlp \
		--zero-stages 0 1 2 3 --max-trials 20 --max-slots 2 --search-range-factor 0.05 $(DEMO_ARGS)

demo-simulated: $(STAMP)
	$(PY) -m dsat asha examples/simulated/gpt2_large.yaml examples/simulated \
		--runner simulated --simulator dsat.runners.simulated.performance_models:gpt2_large_16xv100

bench: $(STAMP)
	$(PY) benchmarks/search_efficiency.py

clean:
	rm -rf $(VENV) dsat-results .pytest_cache .mypy_cache .ruff_cache
