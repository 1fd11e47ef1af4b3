#!/usr/bin/env bash
# The one prepared run for a session lent a GPU machine (the `device` tool runs it in the
# repository root): the CUDA tests, then the CUDA rows of the tree-build and decode benchmarks.
# It uses that machine's own python3 (it holds a CUDA torch, transformers, pytest, pyyaml) and
# no venv; logs go to $OUT (the tool's folder that comes back) or /tmp/ddtree-device.
#   device run: bash scripts/device_check.sh      (about 3-5 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${OUT:-/tmp/ddtree-device}"
mkdir -p "$LOGS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0

"$PY" - <<'PY' 2>&1 | tee "$LOGS/machine.log"
import platform, torch
cuda = torch.cuda.is_available()
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {cuda}",
      torch.cuda.get_device_name(0) if cuda else "")
PY
"$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu tests/integration/test_smoke_cuda.py 2>&1 \
  | tee "$LOGS/gpu-tests.log" || status=1
"$PY" benchmarks/tree_build.py --quick 2>&1 | tee "$LOGS/tree-build.log" || status=1
"$PY" benchmarks/decode.py --budgets 16,64,256 --prompts 3 --tokens 64 2>&1 | tee "$LOGS/decode.log" || status=1
exit $status
