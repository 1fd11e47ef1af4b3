"""The trained tiny pair offline, as an operator runs it: `python -m ddtree.sglang.cpu.tiny_models
--trained DIR` prints the `models:` entry, and `ddtree-ops smoke -H local --stages decode-bench`
decodes its 16 held-out prompts (48 new bytes, T=0, float32 on CPU) with AR, DFlash and DDTree.
Every method gives AR's tokens; DFlash accepts at least 2.5 tokens a round and DDTree at budget
32 at least 1.25 times DFlash (the figures of issue #48, measured on this pair)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("transformers")

from ddtree_ops.cli.app import main  # noqa: E402

pytestmark = pytest.mark.slow
NEW_BYTES = 48


def test_ddtree_accepts_well_beyond_dflash_on_the_trained_pair(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddtree.sglang.cpu.tiny_models", "--trained", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    models = json.loads(done.stdout.strip().splitlines()[-1])
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(tmp_path / "wd"), "models": models}}}))
    runs = tmp_path / "runs"
    code = main(["smoke", "-i", str(inventory), "--runs-dir", str(runs), "-H", "local", "--stages", "decode-bench",
                 "--budgets", "16,32", "--set", f"max_new_tokens={NEW_BYTES}", "--json"])
    stage = json.loads(next(runs.glob("*/local/stages/decode-bench.json")).read_text())
    assert code == 0 and stage["status"] == "pass", stage["reason"]
    rows = {row["method"]: row for row in stage["tables"]["methods"]}
    assert set(rows) == {"baseline", "dflash", "ddtree_tb16", "ddtree_tb32"}
    assert all(row["requests"] == 16 and row["identical_to_ar"] == 1.0 for row in rows.values()), rows
    dflash, tb16, tb32 = rows["dflash"]["tau"], rows["ddtree_tb16"]["tau"], rows["ddtree_tb32"]["tau"]
    assert dflash >= 2.5, rows["dflash"]
    assert tb32 >= 1.25 * dflash, (dflash, tb16, tb32)  # measured 2.88, 3.70, 4.21 (benchmarks/RESULTS.md)
    assert tb16 > dflash, (dflash, tb16)
