"""The core travels alone: it imports with torch only, without operator code."""
from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("ddtree_ops", "typer", "rich", "fabric", "paramiko", "yaml", "sglang", "transformers")

PROBE = """
import json, sys
import torch
import ddtree
print(json.dumps({"modules": sorted(sys.modules)}))
"""


def test_core_imports_with_torch_only():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    loaded = {name.split(".")[0] for name in report["modules"]}
    assert not loaded.intersection(FORBIDDEN), loaded.intersection(FORBIDDEN)
