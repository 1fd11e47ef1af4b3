"""docs/sglang-plugin.md's `$python -m ddtree.sglang.cpu.tiny_models /tmp/tiny`, run as the doc
prints it, in a shell without the CPU server's environment variables (issue #47: it failed with
a long traceback unless SGLANG_USE_CPU_ENGINE=1 was set, which the doc does not say)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from .cpu_server import cpu_env_python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def documented_command() -> str:
    text = (REPO / "docs" / "sglang-plugin.md").read_text(encoding="utf-8")
    found = re.search(r"^(\$python -m ddtree\.sglang\.cpu\.tiny_models /tmp/tiny)\b", text, re.MULTILINE)
    assert found, "docs/sglang-plugin.md no longer prints the tiny_models command"
    return found.group(1)


def test_the_documented_tiny_models_command_works_as_written(tmp_path):
    python = cpu_env_python()
    command = documented_command().replace("/tmp/tiny", str(tmp_path / "tiny"))  # this test's own folder
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "TRITON_", "DDTREE_", "PYTHONPATH"))}
    env["python"] = str(python)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    models = json.loads(done.stdout.strip().splitlines()[-1])
    assert models == {"target": str(tmp_path / "tiny" / "target"), "drafter": str(tmp_path / "tiny" / "drafter"),
                      "block_size": 6, "prompts": str(tmp_path / "tiny" / "prompts.jsonl")}
    assert (tmp_path / "tiny" / "target" / "config.json").is_file()
    assert "Traceback" not in done.stderr
