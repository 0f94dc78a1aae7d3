# From a fresh clone: `make run` or `make test` does all the setup itself.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-quick bench bench-tf-venv setup clean

$(PY):
	python3 -m venv $(VENV)

# The C++ extension (deeprec/csrc) builds against the installed torch, hence no build isolation.
$(STAMP): pyproject.toml setup.py $(wildcard deeprec/csrc/*) | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=68' wheel ninja
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,torchrec,peers]'
	$(PY) -m pip install -q --no-deps torchrec==1.9.2  # see pyproject.toml's torchrec extra
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/deeprec train --model dlrm --epochs 5 --batch-size 32

# The suite on every core (pytest-xdist; tests/conftest.py gives each worker its share of the threads),
# in work units (a test file, a docs page, a compiled model: tests/scheduling.py), the longest first
# (tests/durations.json); the 25 slowest tests listed at the end; each test's time in a JUnit report
# (python tests/durations.py tests/.cache/junit.xml refreshes durations.json from it).
PYTEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25 --junitxml=tests/.cache/junit.xml

# The edit loop: the tests not marked slow (a few minutes)
test-quick: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" --durations=10

bench: $(STAMP)
	$(PY) bench/ops_hash.py
	$(PY) bench/e2e.py
	$(PY) bench/baseline.py

# TensorFlow 2.21 for bench/e2e.py's tf.data + Keras peer, in its own venv (optional; big download)
bench-tf-venv:
	python3 -m venv .venv-tf
	.venv-tf/bin/python -m pip install -q tensorflow-cpu==2.21.0

clean:
	rm -rf $(VENV) .venv-tf *.egg-info build deeprec/*.so
