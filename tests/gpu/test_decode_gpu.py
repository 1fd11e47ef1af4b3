"""The decode loops on CUDA: lossless at T=0 with the tree verify, KV compaction and the
host-built verify inputs (token ids, positions, mask) moved to the device each round."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.lossless import TINY_VOCAB, build_tiny_target, check_lossless, prompt_set  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
]


def test_ddtree_and_dflash_emit_the_autoregressive_tokens_on_cuda(device="cuda"):
    # float64: argmax near-ties between the tree forward and the one-token forward stay out
    # of reach of the kernels' rounding (float32 / TF32 could legitimately differ there)
    target = build_tiny_target(seed=3, device=device, dtype=torch.float64)
    prompts = [p.to(device) for p in prompt_set(3, 7, TINY_VOCAB, seed=103)]
    report = check_lossless(target, prompts, [1, 4, 16, 64, 256], max_new_tokens=32, block_size=8, noise=0.3, seed=3)
    assert report.lossless, report.mismatches[:2]
    assert max(max(r.acceptance_lengths) for r in report.results["ddtree_tb64"]) > 1  # it did speculate
    assert all(r.output_ids.device.type == "cpu" for results in report.results.values() for r in results)
