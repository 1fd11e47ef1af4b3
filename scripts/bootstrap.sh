#!/usr/bin/env bash
# Installs everything the CLI and the test-suite need on a bare Debian/Ubuntu machine:
# OpenSSH (the tests start real sshd processes on 127.0.0.1), rsync (benchmark baseline),
# and a virtual environment with the pinned CPU torch first, so that no CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
TORCH_SPEC_GIVEN="${TORCH_SPEC:-}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client rsync >/dev/null
  else
    echo "bootstrap: need openssh-server, openssh-client and rsync (install them as root)" >&2
  fi
fi

stamp="$VENV/.ddtree-ops-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q -e '.[test]'
  touch "$stamp"
fi
if [ -n "$TORCH_SPEC_GIVEN" ]; then
  # Asked for by name: make the venv's torch match it even when the venv already existed (a
  # no-op when it does). Word-split on purpose: pip options may follow (--index-url ...).
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check $TORCH_SPEC_GIVEN
fi
