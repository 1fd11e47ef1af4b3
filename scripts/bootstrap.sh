#!/usr/bin/env bash
# Installs everything the CLI and the test-suite need on a bare Debian/Ubuntu machine:
# OpenSSH (the tests start real sshd processes on 127.0.0.1), rsync (benchmark baseline),
# and a virtual environment with the pinned CPU torch first, so that no CUDA build is pulled.
# Prints each phase as it starts. BOOTSTRAP_NEEDS_SSHD=1 (`make test`) stops at once, saying
# what to run, when sshd is missing and this user cannot install it; otherwise that is a note.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
TORCH_SPEC_GIVEN="${TORCH_SPEC:-}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SSHD="${SSHD:-/usr/sbin/sshd}"
PACKAGES="openssh-server openssh-client rsync"

phase() { echo "bootstrap: [$1/4] $2" >&2; }

have_sshd() { command -v sshd >/dev/null 2>&1 || [ -x "$SSHD" ]; }

phase 1 "system packages ($PACKAGES)"
if ! have_sshd || ! command -v rsync >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap:       apt-get install $PACKAGES" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PACKAGES >/dev/null
  elif [ "${BOOTSTRAP_NEEDS_SSHD:-0}" = 1 ] && ! have_sshd; then
    echo "bootstrap: error: sshd is not installed and this user cannot install it (the tests start real" >&2
    echo "bootstrap:        sshd processes); run:  sudo apt-get install -y $PACKAGES   then run this again" >&2
    exit 1
  else
    echo "bootstrap:       note: missing some of $PACKAGES (only the test suite needs them);" >&2
    echo "bootstrap:       to install: sudo apt-get install -y $PACKAGES" >&2
  fi
else
  echo "bootstrap:       already installed" >&2
fi

stamp="$VENV/.ddtree-ops-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  phase 2 "virtual environment $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  phase 3 "torch ($TORCH_SPEC; minutes on a first install)"
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  phase 4 "this project (pip install -e '.[test]')"
  "$VENV/bin/python" -m pip install -q -e '.[test]'
  touch "$stamp"
else
  phase 2 "virtual environment $VENV: up to date (torch and this project installed; phases 3-4 skipped)"
fi
if [ -n "$TORCH_SPEC_GIVEN" ]; then
  # Asked for by name: make the venv's torch match it even when the venv already existed (a
  # no-op when it does). Word-split on purpose: pip options may follow (--index-url ...).
  phase 3 "torch as TORCH_SPEC asks ($TORCH_SPEC_GIVEN)"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check $TORCH_SPEC_GIVEN
fi
if [ "${BOOTSTRAP_NEEDS_SGLANG_CPU:-0}" = 1 ]; then
  # `make test`: the real sglang 0.5.23 served on CPU (tests/sglang_server) needs its own venv.
  echo "bootstrap: [+] SGLang CPU test server environment (scripts/sglang_cpu_env.sh; minutes on a first build)" >&2
  bash scripts/sglang_cpu_env.sh >/dev/null
fi
echo "bootstrap: ready" >&2
