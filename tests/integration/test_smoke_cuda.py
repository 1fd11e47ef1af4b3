"""On a CUDA host: the forked worker initialises CUDA itself and the device stages run there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none here)")]

REPO = Path(__file__).resolve().parents[2]


def test_runner_runs_device_stages_on_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "ddtree_ops" / "hostside" / "runner.py"), "run", "--run-id", "cuda",
         "--workdir", str(tmp_path), "--release-root", str(REPO), "--stages",
         "env,golden,invariants,tree-bench", "--options",
         json.dumps({"budgets": [16, 256, 1024], "batch_sizes": [1, 16], "repeat": 5})],
        capture_output=True, text=True, timeout=600)
    ends = {r["stage"]: r for r in map(json.loads, filter(str.strip, proc.stdout.splitlines()))
            if r["event"] == "stage_end"}
    assert proc.returncode == 0, {s: r["reason"] for s, r in ends.items()}
    assert ends["env"]["metrics"]["device"] == "cuda" and ends["env"]["metrics"]["gpu_count"] >= 1
    assert ends["invariants"]["metrics"]["device"] == "cuda"
    assert ends["tree-bench"]["metrics"]["device"] == "cuda"
    assert ends["tree-bench"]["metrics"]["build_ms.batched.bs16.b256"] > 0
    assert ends["tree-bench"]["metrics"]["build_ms.graphed.bs16.b256"] > 0
