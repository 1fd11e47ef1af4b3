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

# pytest-xdist workers: most sshd tests wait on timeouts and remote processes, so one more
# than the cores runs best (3 on 2 cores), at most 8 (one file per worker keeps a module's
# fixtures in one place; the longest files go first, tests/conftest.py). TEST_WORKERS=0 runs
# everything in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n + 1)); [ $$n -gt 8 ] && n=8; echo $$n)

test:
	@BOOTSTRAP_NEEDS_SSHD=1 BOOTSTRAP_NEEDS_SGLANG_CPU=1 bash scripts/bootstrap.sh
	@echo "make test: the whole suite in $(TEST_WORKERS) workers: about 12-14 min on 2 idle cores, 20-30 min beside other work (README)" >&2
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Unit and property tests only: no sshd fleet, nothing marked slow (subprocesses, the real
# SGLang file set, long sweeps: every test over half a second). About 45 s on 2 idle cores.
test-quick: setup
	$(BIN)/python -m pytest -q -m "not slow and not sshd" tests/unit tests/property

bench: setup
	$(BIN)/python benchmarks/tree_build.py
