"""Stage `env`: what this host's Python can run (Python, torch, CUDA and GPUs, SGLang)."""
from __future__ import annotations

import importlib.metadata
import platform
import sys

from ddtree_ops.hostside.protocol import StageContext, StageResult

NAME = "env"
DESCRIPTION = "Python, torch, CUDA/GPUs and SGLang of the host's environment"

MIN_TORCH = (2, 4)  # the oldest torch the core supports (pyproject: torch>=2.4)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _sglang_version() -> str | None:
    # Metadata only: importing sglang takes seconds and needs a GPU for most of it.
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def run(ctx: StageContext) -> StageResult:
    metrics: dict = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "sglang": _sglang_version(),
        "device": ctx.device,
    }
    try:
        import torch
    except ImportError as err:
        return StageResult.failed(f"torch is not importable here: {err}", metrics=metrics)
    metrics["torch"] = torch.__version__
    metrics["torch_cuda"] = torch.version.cuda
    metrics["cuda_available"] = torch.cuda.is_available()
    gpus = []
    if metrics["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name,
                         "memory_gib": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}"})
    metrics["gpu_count"] = len(gpus)
    metrics["gpus"] = gpus
    for key in ("python", "torch", "device", "gpu_count", "sglang"):
        ctx.log(f"{key}: {metrics[key]}")
    if _version_tuple(torch.__version__) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return StageResult.failed(f"torch {torch.__version__} is older than {need}, "
                                  f"the oldest the core supports", metrics=metrics)
    gpu_note = f"{len(gpus)} GPU(s): {gpus[0]['name']}" if gpus else "no GPU"
    sglang_note = f"sglang {metrics['sglang']}" if metrics["sglang"] else "no sglang"
    return StageResult.passed(f"torch {torch.__version__}, {gpu_note}, {sglang_note}",
                              metrics=metrics)
