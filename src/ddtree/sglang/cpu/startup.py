"""Run at interpreter start in the CPU test server's environment (the .pth line written by
ddtree.sglang.cpu.environment), only when SGLang's CPU engine is asked for: makes the
sgl_kernel stand-in importable (after site-packages, so a real sgl_kernel wins), declares
the torchvision schemas SGLang's start-up import of torchvision needs, and lets CPU tensors
record the CPU stream (a no-op)."""
from __future__ import annotations

import sys
from pathlib import Path

from ddtree.sglang.cpu.torch_streams import allow_cpu_record_stream
from ddtree.sglang.cpu.torchvision_ops import declare_missing_schemas

STANDIN_DIR = str(Path(__file__).resolve().parent / "standin")

if STANDIN_DIR not in sys.path:
    sys.path.append(STANDIN_DIR)
declare_missing_schemas()
allow_cpu_record_stream()
