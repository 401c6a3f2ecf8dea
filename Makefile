# `make run` and `make test` each do their own set-up on a fresh machine, from python3 alone: `make run`
# installs what running the starter needs, `make test` and `make install` add the dev tools on top.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
PORT ?= 8000
# What examples/starter.py imports: the webhook source and schedules (each brings the http extra).
RUN_EXTRAS := webhooks,schedules

.PHONY: run demo test bench lint docs install clean

# uv installs a set in seconds where pip takes half a minute or more (pip alone spent 8 s parsing
# pydantic-core's index page); it comes from PyPI through the interpreter's own pip (--python, pip 22.3+:
# it installs into the virtualenv from outside), so the virtualenv is made without a pip of its own,
# which saves seeding one (3 to 18 s on a busy two-core machine). Without a pip beside python3, the
# virtualenv's ensurepip stands in. uv reads no pip.conf: a private index is UV_DEFAULT_INDEX.
$(UV):
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(PY) install --quiet uv 2>/dev/null \
		|| { $(PY) -m ensurepip --default-pip && $(PY) -m pip install --quiet uv; }

# Editable, so that a change to the code needs no reinstall. uv compiles no bytecode at install time
# (Python writes it at the first import of each module, of what is imported only).
$(RUN_STAMP): pyproject.toml | $(UV)
	$(UV) pip install --quiet --python $(PY) -e '.[$(RUN_EXTRAS)]'
	touch $@

# pip too: the tests build and install wheels with it, as a user does.
$(STAMP): pyproject.toml $(RUN_STAMP)
	$(UV) pip install --quiet --python $(PY) -e '.[dev]' pip
	touch $@

install: $(STAMP)

# A worker on the embedded defaults (SQLite file, in-process coordinator): a webhook receiver and a
# schedule (examples/starter.py), served on PORT; it prints a curl command that sends it a signed order.
run: $(RUN_STAMP)
	$(PY) -m examples.starter --port $(PORT)

# The retry-safety recipe of the coordinator's guide, as a table.
demo: $(RUN_STAMP)
	$(VENV)/bin/consumer-kit demo

test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist worksteal

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
