# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
#   make test    .venv with vllm==<base> and its pins (reused while its marker
#                matches), the stock wheel in build/cache, then pytest
#   make fetch   the pinned stock wheel into build/cache, checked against
#                patches/base.json (pip download only, no .venv)
#   make wheel   dist/vllm-<base>+glm5next.kpool<N>-<tags>.whl
#   make lint    ruff check + ruff format --check (build/venv-lint: ruff only)
#   make mutate  mutation testing of the stage's host code: mutmut 3.8.1 (put
#                into .venv) on [tool.mutmut] of pyproject.toml; needs the
#                .venv of make test; hours on 2 cores (docs/mutation.md)
#   make clean   remove build/ and dist/ (make distclean: .venv too)
#
# Base vLLM: <base> (vllm_version in patches/base.json). Variables: PYTHON
# (default python3), PYTEST_ARGS (e.g. -m 'not slow'), WHEEL_ARGS (e.g.
# --wheel /path/to/vllm-<base>-...whl), MUTATE_ARGS (mutant names or globs).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
VENV_MARKER := $(VENV)/.kpool-pins
# The pinned base, from patches/base.json (the one place it is written).
BASE_VERSION := $(shell sed -n 's/^ *"vllm_version": *"\([^"]*\)".*/\1/p' patches/base.json)
ifeq ($(BASE_VERSION),)
$(error patches/base.json: no "vllm_version" found; expected a line like "vllm_version": "0.33.0")
endif
PIP_PIN := pip==26.3
RUFF_PIN := ruff==0.17.6
PINS := vllm==$(BASE_VERSION) pytest==9.1.1 $(RUFF_PIN) wheel==0.48.0
# ruff alone, so that `make lint` needs neither vLLM nor the main venv.
LINT_VENV := build/venv-lint
LINT_MARKER := $(LINT_VENV)/.pins-$(subst ==,-,$(RUFF_PIN))
PYTEST_ARGS ?=
WHEEL_ARGS ?=
# make mutate only: added to .venv, which has what the tests import.
MUTATE_PINS := mutmut==3.8.1
MUTATE_ARGS ?=

.PHONY: help test venv fetch wheel lint mutate clean distclean
.DEFAULT_GOAL := help

# The comment block above, from its first "make" line to the variables.
help:
	@sed -n '/^#   make test/,/MUTATE_ARGS (mutant/p' Makefile | \
	  sed 's/^# \{0,1\}//; s/<base>/$(BASE_VERSION)/g'

venv:
	@want="$(PIP_PIN) $(PINS) python=$$($(PYTHON) -c 'import sys; print(sys.version.split()[0])')"; \
	if [ -x $(VPY) ] && [ "$$(cat $(VENV_MARKER) 2>/dev/null)" = "$$want" ]; then \
	  echo "== venv: reusing $(VENV) ($$want)"; \
	else \
	  start=$$SECONDS; rm -rf $(VENV); \
	  echo "== venv: creating $(VENV): $(PINS) (~9 GB, a few minutes)"; \
	  $(PYTHON) -m venv $(VENV); \
	  $(VPY) -m pip install -q $(PIP_PIN); \
	  $(VPY) -m pip install $(PINS); \
	  echo "$$want" > $(VENV_MARKER); \
	  echo "== venv: created in $$((SECONDS - start)) s"; \
	fi

# tools/build_wheel.py needs the standard library only (and pip to fetch):
# the .venv's python where there is one (make test), else PYTHON.
fetch:
	@start=$$SECONDS; py=$(VPY); [ -x $$py ] || py=$(PYTHON); \
	$$py tools/build_wheel.py --fetch-only; \
	echo "== fetch stock wheel: $$((SECONDS - start)) s"

test: venv fetch
	@start=$$SECONDS; rc=0; \
	KPOOL_REQUIRE_WHEEL=1 $(VPY) -m pytest -q tests $(PYTEST_ARGS) || rc=$$?; \
	echo "== pytest: $$((SECONDS - start)) s, exit $$rc"; \
	if [ $$rc -eq 5 ]; then echo "== pytest ran no tests: failing"; exit 1; fi; \
	exit $$rc

wheel:
	@start=$$SECONDS; $(PYTHON) tools/build_wheel.py $(WHEEL_ARGS); \
	echo "== make wheel: $$((SECONDS - start)) s"

$(LINT_MARKER):
	@rm -rf $(LINT_VENV) && $(PYTHON) -m venv $(LINT_VENV)
	@$(LINT_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	  $(RUFF_PIN) && touch $@

lint: $(LINT_MARKER)
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/ruff format --check .

# Not part of `make test` (.ci/run). mutmut resumes from mutants/ (delete it
# for a fresh run); the forks use one thread each (2 workers on 2 cores).
mutate: venv
	@$(VPY) -m pip install -q $(MUTATE_PINS)
	@start=$$SECONDS; rc=0; \
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run $(MUTATE_ARGS) || rc=$$?; \
	echo "== make mutate: $$((SECONDS - start)) s, exit $$rc"; \
	exit $$rc

clean:
	rm -rf build dist

distclean: clean
	rm -rf $(VENV)
