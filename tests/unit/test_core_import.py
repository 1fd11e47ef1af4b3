"""The core travels alone: it imports with torch only, without operator code."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("ddtree_ops", "typer", "rich", "fabric", "paramiko", "yaml", "sglang", "transformers")

PROBE = """
import json, sys
import torch
import ddtree
print(json.dumps({"modules": sorted(sys.modules)}))
"""


@pytest.mark.slow
def test_core_imports_with_torch_only():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    loaded = {name.split(".")[0] for name in report["modules"]}
    assert not loaded.intersection(FORBIDDEN), loaded.intersection(FORBIDDEN)


# The stdlib-only SGLang tools: a host checks its SGLang before torch is even installed.
NO_TORCH = """
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ddtree.sglang.gate, ddtree.sglang.manifest_tool, ddtree.sglang.manifests
from ddtree.sglang.manifests import SUPPORTED
assert SUPPORTED
print(json.dumps({"modules": sorted(sys.modules)}))
"""


def test_the_gate_and_manifest_tools_import_without_torch():
    result = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = {name.split(".")[0] for name in json.loads(result.stdout)["modules"]}
    assert "numpy" not in loaded and not loaded.intersection(FORBIDDEN)


def test_the_core_names_still_resolve_from_the_package():
    import ddtree

    assert len(ddtree.__all__) == 25
    missing = [name for name in ddtree.__all__ if getattr(ddtree, name, None) is None]
    assert missing == []
    assert ddtree.build_ddtree_trees.__module__ == "ddtree.batched"
