#!/usr/bin/env bash
# Builds the CPU test server's environment: a venv with torch 2.13.0 (CPU), the pinned
# install set of constraints/sglang-0.5.23-cpu.txt (the real sglang 0.5.23 among it), this
# checkout's ddtree (editable, no deps: the plugin's entry points) and the one .pth file
# that lets SGLang's CPU engine start (ddtree.sglang.cpu.environment). Idempotent: a stamp
# holding the constraints file's hash skips a finished build. Prints the venv's python on
# stdout; on stderr, each step as it starts and a line at least every 20 s while it runs.
#   SGLANG_CPU_VENV (default .cache/sglang-cpu-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh

VENV="${SGLANG_CPU_VENV:-.cache/sglang-cpu-venv}"
SET=constraints/sglang-0.5.23-cpu.txt
want="$(sha256sum "$SET" | cut -d' ' -f1)"
stamp="$VENV/.ddtree-sglang-cpu"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
say=sglang-cpu-env
echo "$say: building $VENV for the SGLang CPU test server (about 3 min on 2 idle cores with a" >&2
echo "$say: warm pip cache; more on a first download: about 1.5 GB of wheels)" >&2
rm -rf "$VENV"
pip_() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
step "$say" "[1/5] virtual environment (seconds)" python3 -m venv "$VENV"
step "$say" "[2/5] torch==2.13.0, the CPU build (about 1 min)" pip_ torch==2.13.0
step "$say" "[3/5] sglang 0.5.23 and its pinned CPU install set, $SET (about 2 min)" pip_ --no-deps -r "$SET"
step "$say" "[4/5] this checkout's ddtree, editable (seconds)" pip_ --no-deps -e .
step "$say" "[5/5] the CPU server's .pth hook (seconds)" "$VENV/bin/python" -c \
  "import sysconfig; from ddtree.sglang.cpu.environment import install_pth; install_pth(sysconfig.get_paths()['purelib'])"
echo "$want" > "$stamp"
echo "$VENV/bin/python"
