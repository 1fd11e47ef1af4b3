# Two commands on a fresh machine:  `make run` (the main job on the embedded `local` host)
# and `make test` (the whole suite, real sshd fleet included). Both set themselves up.
# `make test-quick`: unit and property tests only, for the edit-test loop.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-quick bench

setup:
	@bash scripts/bootstrap.sh

run: setup
	$(BIN)/ddtree-ops hosts check -H local
	$(BIN)/ddtree-ops smoke -H local

test:
	@BOOTSTRAP_NEEDS_SSHD=1 bash scripts/bootstrap.sh
	$(BIN)/python -m pytest -q

# Unit and property tests only: no sshd fleet, no runner subprocesses (marked slow).
test-quick: setup
	$(BIN)/python -m pytest -q -m "not slow and not sshd" tests/unit tests/property

bench: setup
	$(BIN)/python benchmarks/tree_build.py
