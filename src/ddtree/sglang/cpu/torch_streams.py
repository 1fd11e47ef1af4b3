"""Tensor.record_stream for CPU tensors on the CPU "stream", as a no-op.

SGLang's DFlash worker calls `seq_lens.record_stream(torch.get_device_module(device)
.current_stream())` every decode round (srt/speculative/dflash_worker_v2.py:2481-2483; our
worker mirrors it). On CPU that is torch.cpu.Stream, which Tensor.record_stream rejects
("unknown parameter type"); CPU work runs in order on one stream, so there is nothing to
record. Any other call goes to torch's own method unchanged."""
from __future__ import annotations

import torch

_ORIGINAL = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream) -> None:
    if isinstance(stream, torch.cpu.Stream) and tensor.device.type == "cpu":
        return None
    return _ORIGINAL(tensor, stream)


def allow_cpu_record_stream() -> None:
    if torch.Tensor.record_stream is not _record_stream:
        torch.Tensor.record_stream = _record_stream  # type: ignore[method-assign]
