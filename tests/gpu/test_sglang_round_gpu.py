"""The SGLang plugin's round on CUDA: no host sync (scripts/device_check.sh runs it)."""
from __future__ import annotations

import pytest
import torch

from sglang_plugin.round_case import ROUND_SHAPES, round_between_forwards, round_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
]


@pytest.mark.parametrize("bs, block, budget, world", ROUND_SHAPES)
def test_the_round_makes_no_host_sync_on_cuda(bs, block, budget, world):
    """The same round on CUDA under torch.cuda.set_sync_debug_mode("error") (after a warm-up:
    first calls may allocate and sync)."""
    case = round_case("cuda", bs, block, budget, world)
    round_between_forwards(case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_between_forwards(case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
