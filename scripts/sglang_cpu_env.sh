#!/usr/bin/env bash
# Builds the CPU test server's environment: a venv with torch 2.13.0 (CPU), the pinned
# install set of constraints/sglang-0.5.23-cpu.txt (the real sglang 0.5.23 among it), this
# checkout's ddtree (editable, no deps: the plugin's entry points) and the one .pth file
# that lets SGLang's CPU engine start (ddtree.sglang.cpu.environment). Idempotent: a stamp
# holding the constraints file's hash skips a finished build. Prints the venv's python.
#   SGLANG_CPU_VENV (default .cache/sglang-cpu-venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SGLANG_CPU_VENV:-.cache/sglang-cpu-venv}"
SET=constraints/sglang-0.5.23-cpu.txt
want="$(sha256sum "$SET" | cut -d' ' -f1)"
stamp="$VENV/.ddtree-sglang-cpu"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "sglang-cpu-env: building $VENV (minutes on a first build: about 1.5 GB of wheels)" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
pip_() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip_ torch==2.13.0
pip_ --no-deps -r "$SET"
pip_ --no-deps -e .
"$VENV/bin/python" -c "import sysconfig; from ddtree.sglang.cpu.environment import install_pth; install_pth(sysconfig.get_paths()['purelib'])"
echo "$want" > "$stamp"
echo "$VENV/bin/python"
