"""Declares the two torchvision op schemas that torchvision's Python side registers fake
kernels for at import (torchvision/_meta_registrations.py:163,177, 0.28.0).

Why: SGLang 0.5.23 imports torchvision.transforms at start-up even for text models
(srt/configs/__init__.py:71 -> configs/nano_nemotron_vl.py:22 ->
srt/multimodal/internvl_utils.py:5). PyPI's torchvision wheels are CUDA builds whose _C
cannot load beside a CPU torch, and then that import fails on the missing schemas. Declaring
them (no kernels) lets the pure-Python transforms import; calling nms would still fail."""
from __future__ import annotations

import torch

_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def declare_missing_schemas() -> list[str]:
    """Define each schema torchvision's own _C did not; returns the names defined here."""
    defined = []
    for name, schema in _SCHEMAS.items():
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
            continue  # a working torchvision _C registered it
        except RuntimeError:
            pass
        torch.library.define(f"torchvision::{name}", schema)
        defined.append(name)
    return defined


def import_torchvision() -> None:
    """Import torchvision as a process outside a CPU server needs it (transformers' model
    classes import it): where its compiled ops load, as they are; where they cannot (the CUDA
    wheel beside a CPU torch), with the schemas above declared first. Declared only after a
    failed import, so a working torchvision never meets them. Not installed: nothing to do."""
    import sys

    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        return  # not installed: transformers does without it
    except RuntimeError:  # "operator torchvision::nms does not exist"
        pass
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package, imported again below
    declare_missing_schemas()
    import torchvision  # noqa: F401,F811
