# `make run` and `make test` each do their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench lint install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/consumer-kit demo

test: $(STAMP)
	$(PY) -m pytest -q -n 3

bench: $(STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check consumer_kit sources tests bench examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info consumer-kit.db consumer-kit.db.hmac-key
