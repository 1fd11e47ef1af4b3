"""The CPU test server's pieces that need no SGLang: inert unless prepared, the .pth, the
record_stream no-op (the parity and end-to-end tests are in tests/sglang_server)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ddtree.sglang.cpu import environment, server_plugin


def test_server_plugin_is_inert_outside_a_prepared_environment():
    assert not server_plugin.cpu_test_server_active()
    server_plugin.register()  # would import sglang if it did anything
    assert "sglang" not in sys.modules


def test_pth_marks_the_environment_and_activates_only_with_the_cpu_engine(tmp_path):
    assert not environment.prepared(tmp_path)
    path = environment.install_pth(tmp_path)
    assert environment.prepared(tmp_path) and path.name == environment.PTH_NAME
    line = path.read_text()
    for value, active in (("1", True), ("0", False)):
        code = f"import os, sys\nos.environ['SGLANG_USE_CPU_ENGINE'] = {value!r}\n{line}\nprint('ddtree.sglang.cpu.startup' in sys.modules)"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(active)


def test_record_stream_is_a_no_op_only_for_cpu_tensors_on_the_cpu_stream():
    tensor = torch.zeros(3)
    with pytest.raises(RuntimeError):  # torch's own behaviour (this process has no shim), as SGLang hits it
        tensor.record_stream(torch.cpu.current_stream())
    done = subprocess.run([sys.executable, "-c", (
        "import torch\nfrom ddtree.sglang.cpu.torch_streams import allow_cpu_record_stream\n"
        "allow_cpu_record_stream()\ntorch.zeros(3).record_stream(torch.cpu.current_stream())\n"
        "try:\n    torch.zeros(3).record_stream(object())\nexcept (RuntimeError, TypeError):\n    print('other calls unchanged')\n")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "other calls unchanged"


def test_a_ddtree_verify_without_its_tree_mask_is_refused():
    from ddtree.sglang.cpu.tree_mask_guard import MissingTreeMaskError, require_tree_mask

    mask = torch.ones(12, dtype=torch.bool)
    with pytest.raises(MissingTreeMaskError, match=r"target-verify batch \(9 tokens per request, layer 3\) arrived "
                                                   r"without a tree mask while the DDTree plugin is enabled"):
        require_tree_mask(None, causal=True, trees_expected=True, layer_id=3, width=9)
    require_tree_mask(mask, causal=True, trees_expected=True, layer_id=0, width=9)  # a tree with its mask
    require_tree_mask(None, causal=True, trees_expected=False, layer_id=0, width=16)  # DFlash's linear verify
    require_tree_mask(None, causal=False, trees_expected=True, layer_id=0, width=16)  # the drafter's block


def test_trees_are_expected_exactly_when_the_ddtree_plugin_is_enabled(monkeypatch):
    from ddtree.sglang import hooks
    from ddtree.sglang.config import load_config
    from ddtree.sglang.cpu.tree_mask_guard import ddtree_trees_expected

    monkeypatch.setattr(hooks, "_CONFIG", None)
    for value, expected in (("1", True), ("0", False)):
        hooks.set_active_config(load_config({"DDTREE_ENABLE": value}))
        assert ddtree_trees_expected() is expected


def test_cpu_test_faults_are_named_and_unknown_ones_refused():
    from ddtree.sglang.cpu import faults

    assert faults.requested_fault({}) is None
    target, wrapper = faults.requested_fault({faults.ENV_FAULT: "verify-without-tree-mask"})
    assert target == "ddtree.sglang.worker.DDTreeWorkerV2._target_verify"
    seen = []
    wrapper(lambda *args: seen.append(args), "worker", "batch", "draft", "inputs", "mask", "locs", "plan")
    assert seen == [("worker", "batch", "draft", "inputs", None, "locs", "plan")]
    with pytest.raises(ValueError, match="CPU_TEST_SERVER_FAULT='nope': unknown fault"):
        faults.requested_fault({faults.ENV_FAULT: "nope"})


def test_the_drafting_faults_keep_the_shape_and_change_what_the_tree_is_built_from():
    """topk1 hands the tree builder each depth's top-1 only; shift-depth depth d + 1's rows."""
    import torch

    from ddtree.sglang.cpu import faults
    from ddtree.topk import ShardTopK

    values = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    top = ShardTopK(values, values.long() + 100, values[..., 0] * 10)
    seen = []
    for name in ("topk1", "shift-depth"):
        target, wrapper = faults.requested_fault({faults.ENV_FAULT: name})
        assert target == "ddtree.sglang.tree_round.trees_from_top_k"
        wrapper(lambda t, budget: seen.append((t, budget)), top, 16)
    (top1, b1), (shifted, b2) = seen
    assert b1 == b2 == 16
    assert torch.equal(top1.token_ids, top.token_ids[..., :1]) and torch.equal(top1.lse, top.lse)
    assert torch.equal(shifted.token_ids[:, :2], top.token_ids[:, 1:])
    assert torch.equal(shifted.token_ids[:, 2], top.token_ids[:, 2]) and torch.equal(shifted.lse[:, 0], top.lse[:, 1])
