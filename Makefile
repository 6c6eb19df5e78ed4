# Both targets bootstrap .venv themselves, so they work on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: run demo test test-all presets clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Main job: the test-time memorisation experiment (table + PNG under results/).
run: $(STAMP)
	$(VENV)/bin/atlas-jax memorize $(ARGS)

# Tiny ATLAS and Transformer++ trained the same way on the built-in corpus (runs/demo).
demo: $(STAMP)
	$(VENV)/bin/atlas-jax demo --out runs/demo $(ARGS)

# --durations: CI keeps the end of the log, so the slowest tests show there.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=10 $(ARGS)

# Includes the slow tests; GPU tests still need a GPU (-m gpu on the device machine).
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not gpu" $(ARGS)

presets: $(STAMP)
	$(VENV)/bin/atlas-jax presets

clean:
	rm -rf $(VENV) results runs .pytest_cache
