"""Turns a Python environment holding sglang 0.5.23 (and the CPU install set of
constraints/sglang-0.5.23-cpu.txt) into one whose SGLang can serve on CPU: one .pth file.

The .pth imports ddtree.sglang.cpu.startup only in processes started with
SGLANG_USE_CPU_ENGINE=1, so pip and every other program in that environment are untouched,
and removing the file undoes everything."""
from __future__ import annotations

from pathlib import Path

PTH_NAME = "ddtree_sglang_cpu.pth"
PTH_LINE = (
    "import os; os.environ.get('SGLANG_USE_CPU_ENGINE') == '1' and "
    "__import__('ddtree.sglang.cpu.startup')\n"
)

# What a CPU server process needs in its environment (SGLang reads each at import).
SERVER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # is_cpu() (srt/utils/common.py:221)
    "TRITON_INTERPRET": "1",  # SGLang's Triton kernels run on CPU tensors, interpreted
}


def _purelib() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def prepared(site_packages: Path | None = None) -> bool:
    """Whether this interpreter's environment (or `site_packages`) is a CPU test server's."""
    return (Path(site_packages) if site_packages is not None else _purelib()).joinpath(PTH_NAME).is_file()


# The server flags a CPU test server needs beyond a GPU host's (SGLang's own flags).
SERVER_ARGS = (
    "--device", "cpu", "--dtype", "bfloat16",  # bfloat16: DFlash casts to it (model_runner.py:1772)
    "--attention-backend", "ddtree_cpu",  # ddtree.sglang.cpu.attention
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--max-total-tokens", "4096",  # else the KV pool takes most of the machine's memory
)


def install_pth(site_packages: Path) -> Path:
    """Write the .pth into `site_packages`; returns its path."""
    path = Path(site_packages) / PTH_NAME
    path.write_text(PTH_LINE)
    return path
