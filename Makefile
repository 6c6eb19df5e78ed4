# Both targets bootstrap .venv themselves, so they work on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: run demo memorize test test-all presets clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Main job: a tiny ATLAS and a tiny Transformer++ trained the same way on the built-in corpus,
# held-out perplexities, samples, checkpoints, logs and plots under runs/demo.
run: $(STAMP)
	$(VENV)/bin/atlas-jax demo --out runs/demo $(ARGS)

demo: run

# The test-time memorisation experiment (table + PNG under results/memorization).
memorize: $(STAMP)
	$(VENV)/bin/atlas-jax memorize $(ARGS)

# --durations: CI keeps the end of the log, so the slowest tests show there. --dist loadfile: a
# test file's programs are compiled by one worker instead of both (16:21-17:01 against 17:06-18:11
# on a 2-core machine, 2026-12-02: a small gain, near the run-to-run spread).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 $(ARGS)

# Includes the slow tests; GPU tests still need a GPU (-m gpu on the device machine).
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not gpu" $(ARGS)

presets: $(STAMP)
	$(VENV)/bin/atlas-jax presets

clean:
	rm -rf $(VENV) results runs .pytest_cache
