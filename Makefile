# Every target creates .venv when missing and installs what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench docs clean

$(STAMP): pyproject.toml setup.py jaxhistory/_speedups.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# (a stale build of the C helpers must not outlive a failed one)
	rm -f jaxhistory/_speedups*.so
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal tests

docs: $(STAMP)
	$(BIN)/python docs/make_images.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: $(STAMP)
	$(BIN)/ruff check jaxhistory tests benchmarks examples docs/make_images.py docs/griffe_roles.py
	$(BIN)/ruff format --check jaxhistory tests benchmarks examples docs/make_images.py docs/griffe_roles.py
	$(BIN)/python -m mypy jaxhistory

format: $(STAMP)
	$(BIN)/ruff check --fix jaxhistory tests benchmarks examples docs/make_images.py docs/griffe_roles.py
	$(BIN)/ruff format jaxhistory tests benchmarks examples docs/make_images.py docs/griffe_roles.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_reducers.py --out benchmarks/results/reducers.md
	$(BIN)/python benchmarks/bench_history.py --out benchmarks/results/history.md
	$(BIN)/python benchmarks/bench_export.py --out benchmarks/results/export.md
	$(BIN)/python benchmarks/bench_memory.py --out benchmarks/results/memory.md
	$(BIN)/python benchmarks/bench_publish.py --out benchmarks/results/publish.md
	$(BIN)/python benchmarks/bench_multihost.py --out benchmarks/results/multihost.md
	$(BIN)/python benchmarks/bench_stall.py --out benchmarks/results/stall.md
	$(BIN)/python benchmarks/bench_scale.py --out benchmarks/results/scale.md
	$(BIN)/python benchmarks/bench_metrics.py --out benchmarks/results/metrics.md
	$(BIN)/python benchmarks/bench_watch.py --out benchmarks/results/watch.md
	$(BIN)/python benchmarks/bench_pod.py --out benchmarks/results/pod.md

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache .mypy_cache
