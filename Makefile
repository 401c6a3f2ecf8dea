# `make run` and `make test` each do their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8000

.PHONY: run demo test bench lint docs install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# A worker on the embedded defaults (SQLite file, in-process coordinator): a webhook receiver and a
# schedule (examples/starter.py), served on PORT; it prints a curl command that sends it a signed order.
run: $(STAMP)
	$(PY) -m examples.starter --port $(PORT)

# The retry-safety recipe of the coordinator's guide, as a table.
demo: $(STAMP)
	$(VENV)/bin/consumer-kit demo

test: $(STAMP)
	$(PY) -m pytest -q -n 3

bench: $(STAMP)
	$(PY) -m bench

# The documentation site from docs/ into site/; --strict turns every warning (a broken link, a page
# missing from the navigation) into a failure.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check consumer_kit sources tests bench examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) site *.egg-info consumer-kit.db consumer-kit.db-* consumer-kit.db.hmac-key consumer-kit.db.webhook-secret
