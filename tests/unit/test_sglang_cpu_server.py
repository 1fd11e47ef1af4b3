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
