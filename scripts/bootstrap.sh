#!/usr/bin/env bash
# Installs everything the CLI and the test-suite need on a bare Debian/Ubuntu machine:
# OpenSSH (the tests start real sshd processes on 127.0.0.1), rsync (benchmark baseline),
# and a virtual environment with the pinned CPU torch first, so that no CUDA build is pulled,
# then this project with the exact versions of constraints/ddtree-ops.txt (what we install is
# pinned; `bash scripts/refresh_constraints.sh` moves the pins, on purpose).
# Each phase says what it builds and about how long it takes (2 idle cores), and a long one
# says it is still at it every 20 s. The venv is rebuilt when pyproject.toml, the constraints
# file or TORCH_SPEC changed since it was made. BOOTSTRAP_NEEDS_SSHD=1 (`make test`) stops at
# once, saying what to run, when sshd is missing and this user cannot install it; otherwise
# that is a note.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh

VENV="${VENV:-.venv}"
TORCH_SPEC_GIVEN="${TORCH_SPEC:-}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
CONSTRAINTS="${CONSTRAINTS:-constraints/ddtree-ops.txt}"
SSHD="${SSHD:-/usr/sbin/sshd}"
PACKAGES="openssh-server openssh-client rsync"
say=bootstrap

phase() { echo "$say: [$1/4] $2" >&2; }

have_sshd() { command -v sshd >/dev/null 2>&1 || [ -x "$SSHD" ]; }

phase 1 "system packages ($PACKAGES)"
if ! have_sshd || ! command -v rsync >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "$say" "      apt-get install $PACKAGES (about 1 min)" bash -c \
      "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PACKAGES >/dev/null"
  elif [ "${BOOTSTRAP_NEEDS_SSHD:-0}" = 1 ] && ! have_sshd; then
    echo "$say: error: sshd is not installed and this user cannot install it (the tests start real" >&2
    echo "$say:        sshd processes); run:  sudo apt-get install -y $PACKAGES   then run this again" >&2
    exit 1
  else
    echo "$say:       note: missing some of $PACKAGES (only the test suite needs them);" >&2
    echo "$say:       to install: sudo apt-get install -y $PACKAGES" >&2
  fi
else
  echo "$say:       already installed" >&2
fi

# The pins fit the Python they were resolved on (the file's `# python:` line); another Python
# gets the newest allowed versions, and is told so.
pinned_python="$(sed -n 's/^# python: *//p' "$CONSTRAINTS" | head -n1)"
this_python="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$pinned_python" = "$this_python" ]; then
  pins=(-c "$CONSTRAINTS")
  pinned="the exact versions of $CONSTRAINTS"
else
  pins=()
  pinned="the newest versions pyproject.toml allows (NOT pinned: $CONSTRAINTS is for Python $pinned_python, this is $this_python; bash scripts/refresh_constraints.sh pins them for it)"
fi

stamp="$VENV/.ddtree-ops-installed"
want="$(cat pyproject.toml "$CONSTRAINTS" | sha256sum | cut -d' ' -f1) ${TORCH_SPEC} ${this_python}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if [ -f "$stamp" ]; then
    echo "$say: pyproject.toml, $CONSTRAINTS or TORCH_SPEC changed since $VENV was set up: installing again" >&2
  fi
  phase 2 "virtual environment $VENV with pip from $CONSTRAINTS (seconds)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" --upgrade pip setuptools >/dev/null
  pip_() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
  if [ -n "$TORCH_SPEC_GIVEN" ]; then
    # Named on purpose (a CUDA build on a GPU machine): that torch decides its own
    # dependencies, so they are left out of the pins. Word-split on purpose: pip options may
    # follow (--index-url ...).
    # shellcheck disable=SC2086
    step "$say" "[3/4] torch as TORCH_SPEC asks ($TORCH_SPEC_GIVEN; minutes on a first install)" \
      pip_ $TORCH_SPEC_GIVEN
    if [ ${#pins[@]} -gt 0 ]; then
      "$VENV/bin/python" scripts/constraints_without_torch.py "$CONSTRAINTS" > "$VENV/constraints.txt"
      pins=(-c "$VENV/constraints.txt")
    fi
  else
    step "$say" "[3/4] torch ($TORCH_SPEC, the CPU build: about 1 min on a first install, 200 MB)" \
      pip_ "${pins[@]}" "$TORCH_SPEC"
  fi
  build_pins=()
  [ ${#pins[@]} -gt 0 ] && build_pins=(--build-constraint "${pins[1]}")
  step "$say" "[4/4] this project, pip install -e '.[test]' with $pinned (about 1 min on a first install)" \
    pip_ "${pins[@]}" "${build_pins[@]}" -e '.[test]'
  echo "$want" > "$stamp"
else
  phase 2 "virtual environment $VENV: up to date with pyproject.toml and $CONSTRAINTS (phases 3-4 skipped)"
fi
if [ "${BOOTSTRAP_NEEDS_SGLANG_CPU:-0}" = 1 ]; then
  # `make test`: the real sglang 0.5.23 served on CPU (tests/sglang_server) needs its own venv.
  echo "$say: [+] SGLang CPU test server environment (scripts/sglang_cpu_env.sh; about 3 min on a first build, then seconds)" >&2
  bash scripts/sglang_cpu_env.sh >/dev/null
fi
echo "$say: ready" >&2
