#!/usr/bin/env bash
# The one prepared run on a GPU machine (run in the repository root): the CUDA tests, the SGLang
# plugin's GPU checks, then the CUDA rows of the tree-build and decode benchmarks.
# It uses that machine's own python3 (it holds a CUDA torch, transformers, pytest, pyyaml) and
# no venv; logs go to $OUT when it is set, else /tmp/ddtree-device.
#   usage: bash scripts/device_check.sh      (about 6-8 minutes on an H200)
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
# The SGLang plugin (docs/dev/sglang-ddtree-roadmap.md, "GPU checks"). tests/gpu above already ran
# its round under torch.cuda.set_sync_debug_mode("error") (point 1). Here SGLang 0.5.23's own
# Triton kernels, compiled for this GPU, on DDTree's inputs (points 5 and 9); they read the real
# sglang wheel, downloaded into .cache/wheels by pip (on a host without network, bring it there).
TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -rs tests/unit/test_sglang_triton_kernels.py 2>&1 \
  | tee "$LOGS/sglang-kernels.log" || status=1
# Where SGLang itself is installed (an operator's GPU host): SGLang's own plugin loader must apply
# every hook (verdict hooks-applied), then the smoke stages start real servers: the plugin
# stage, and sglang-e2e (DDTree vs DFlash vs no speculation; it skips, saying why, without
# `models:` for this host). A refusal at startup (points 3, 4, 10) is named in their logs.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" 2>/dev/null; then
  "$PY" -m ddtree.sglang.probe 2>&1 | tee "$LOGS/sglang-probe.log" || status=1
  if command -v ddtree-ops >/dev/null; then
    # decode-bench calibrates the throughput model (predictions); sglang-e2e drives each server
    # at 1 and 8 concurrent requests; report then recommends a budget per load beside them.
    ddtree-ops smoke -H local --stages plugin,decode-bench,sglang-e2e 2>&1 | tee "$LOGS/sglang-smoke.log" || status=1
    ddtree-ops report 2>&1 | tee "$LOGS/sglang-report.log" || status=1
    # The tiny random target and drafter the CPU test server uses (tests/sglang_server), now
    # served by SGLang on this GPU: what the CPU run could not show (roadmap, "a GPU run must
    # confirm", c3 c5 c7): CUDA sgl-kernel ops, the FlashInfer/Triton tree-mask verify, CUDA graphs, real
    # streams, token identity in GPU bf16. The rows say `device: cuda`.
    TINY="$LOGS/tiny-models"; mkdir -p "$TINY"
    if "$PY" -m ddtree.sglang.cpu.tiny_models "$TINY/models" >"$TINY.json" 2>"$TINY.err"; then
      "$PY" -c 'import json, sys, yaml; models = json.loads(open(sys.argv[1]).read().splitlines()[-1])
yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": sys.argv[2] + "/wd", "python": sys.argv[3],
                "models": models}}}, open(sys.argv[2] + "/hosts.yaml", "w"))' "$TINY.json" "$TINY" "$(command -v "$PY")"
      DDTREE_OPS_INVENTORY="$TINY/hosts.yaml" DDTREE_OPS_RUNS_DIR="$TINY/runs" ddtree-ops smoke -H local \
        --stages plugin,sglang-e2e --budgets 8,32 2>&1 | tee "$LOGS/sglang-tiny-smoke.log" || status=1
      # Each request's acceptance on the GPU server against the bf16 offline loop on its text
      # (docs/smoke.md, "Is DDTree in my server accepting what it should?"): the table, exit 5 on
      # a regression, and the measured server-vs-offline margin noise in the no-spec row.
      DDTREE_OPS_INVENTORY="$TINY/hosts.yaml" DDTREE_OPS_RUNS_DIR="$TINY/runs" ddtree-ops report 2>&1 \
        | tee "$LOGS/sglang-tiny-report.log" || status=1
      # The plugin's Prometheus series on this GPU (docs/observing.md): /metrics equal to its own
      # counters, the tree-build time from CUDA events present (about a minute).
      PYTHONPATH="$PWD:$PYTHONPATH" "$PY" scripts/device_metrics_check.py "$TINY.json" "$LOGS" 2>&1 \
        | tee "$LOGS/sglang-metrics-check.log" || status=1
    else
      cat "$TINY.err" | tee "$LOGS/sglang-tiny-smoke.log"; status=1
    fi
    # The trained tiny pair (committed; its drafter is NeoX-RoPE like the published ones): on a GPU
    # SGLang runs the compiled fused QK-norm + RoPE kernel on it (roadmap c8), where the CPU
    # server runs ddtree.sglang.cpu.fused_rope. decode-bench gives the offline taus (CUDA bf16),
    # sglang-e2e the server's acceptance beside them; both logs in sglang-trained-smoke.log.
    TRAINED="$LOGS/trained-pair"; mkdir -p "$TRAINED"
    if "$PY" -m ddtree.sglang.cpu.tiny_models --trained "$TRAINED/models" >"$TRAINED.json" 2>"$TRAINED.err"; then
      "$PY" -c 'import json, sys, yaml; models = json.loads(open(sys.argv[1]).read().splitlines()[-1])
yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": sys.argv[2] + "/wd", "python": sys.argv[3],
                "models": models}}}, open(sys.argv[2] + "/hosts.yaml", "w"))' "$TRAINED.json" "$TRAINED" "$(command -v "$PY")"
      DDTREE_OPS_INVENTORY="$TRAINED/hosts.yaml" DDTREE_OPS_RUNS_DIR="$TRAINED/runs" ddtree-ops smoke -H local \
        --stages decode-bench,sglang-e2e --budgets 16,32 --set max_new_tokens=48 2>&1 \
        | tee "$LOGS/sglang-trained-smoke.log" || status=1
      # The server's acceptance per request against the bf16 offline loop and decode-bench's tau
      # (DDTree above DFlash at 16 and 32; exit 5 on a regression).
      DDTREE_OPS_INVENTORY="$TRAINED/hosts.yaml" DDTREE_OPS_RUNS_DIR="$TRAINED/runs" ddtree-ops report 2>&1 \
        | tee "$LOGS/sglang-trained-report.log" || status=1
    else
      cat "$TRAINED.err" | tee "$LOGS/sglang-trained-smoke.log"; status=1
    fi
  fi
else
  echo "sglang is not installed for $PY: the in-server checks (probe, plugin and sglang-e2e stages) did not run" \
    | tee "$LOGS/sglang-probe.log"
fi
"$PY" benchmarks/tree_build.py --quick 2>&1 | tee "$LOGS/tree-build.log" || status=1
"$PY" benchmarks/decode.py --budgets 16,64,256 --prompts 3 --tokens 64 2>&1 | tee "$LOGS/decode.log" || status=1
exit $status
