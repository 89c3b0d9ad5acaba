# make demo  - the main job, offline, on this machine: data, train (CPU preset), official metric
# make test  - the test suite
# Both install into .venv first. TORCH is what pip installs for PyTorch; inside a Neuron venv,
# skip make and run the commands of the README directly.
PYTHON ?= python3
TORCH ?= torch==2.13.0
# test processes side by side (pytest-xdist), one per core
TEST_PROCS ?= 2
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

install: $(VENV)/installed

demo: install
	$(PY) prepare.py setup --source stdlib
	$(PY) train.py --preset cpu --no-eval-public
	$(PY) prepare.py eval-public --train-py train.py --checkpoint out/final.pt

test: install
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadgroup tests

.PHONY: install demo test
