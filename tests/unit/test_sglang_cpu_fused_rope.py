"""The CPU stand-in for the drafter's fused QK-norm + NeoX RoPE kernel, without SGLang: its sum
is numpy's (what Triton's interpreter runs), and it computes the kernel's math, NeoX style.
(Against SGLang's own kernel in the interpreter: tests/sglang_server/test_cpu_parity.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.sglang.cpu.fused_rope import pairwise_sum, table_qk_norm_rope_cpu, to_bfloat16


@pytest.mark.parametrize("length", [1, 5, 8, 16, 24, 31, 32, 64, 127, 128, 129, 200, 256, 512])
def test_pairwise_sum_is_numpys_float32_sum_bit_for_bit(length):
    generator = torch.Generator().manual_seed(length)
    rows = torch.randn(64, length, generator=generator) * torch.logspace(-3, 3, length)
    ours = pairwise_sum(rows)
    numpys = torch.from_numpy(np.sum(rows.numpy(), axis=-1))
    assert torch.equal(ours.view(torch.int32), numpys.view(torch.int32))


def test_bfloat16_casts_round_to_nearest_or_truncate():
    values = torch.tensor([1.0 + 2 ** -8 + 2 ** -10, -(1.0 + 2 ** -8 + 2 ** -10), 3.0])
    assert to_bfloat16(values, truncate=False).tolist() == [1.0 + 2 ** -7, -(1.0 + 2 ** -7), 3.0]
    assert to_bfloat16(values, truncate=True).tolist() == [1.0, -1.0, 3.0]


def reference(qkv, positions, q_weight, k_weight, table, hq, hk, d, eps):
    """The kernel's math in float64 with NeoX halves, no intermediate rounding."""
    out = qkv.double().clone()
    half = d // 2
    for t in range(qkv.shape[0]):
        cos, sin = table[positions[t], :half].double(), table[positions[t], half:].double()
        for h in range(hq + hk):
            x = out[t, h * d:(h + 1) * d]
            weight = (q_weight if h < hq else k_weight).double()
            x = x / torch.sqrt(x.pow(2).mean() + eps) * weight
            x1, x2 = x[:half].clone(), x[half:].clone()
            out[t, h * d: h * d + half] = x1 * cos - x2 * sin
            out[t, h * d + half:(h + 1) * d] = x2 * cos + x1 * sin
    return out


def test_table_qk_norm_rope_normalises_and_rotates_q_and_k_halves_in_place():
    torch.manual_seed(0)
    hq, hk, d, tokens = 4, 2, 32, 5
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d) * 3).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 7, 300, 1023])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(1024).float()[:, None] * inv_freq[None]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [1024, d]: cos then sin, as SGLang's cache
    q_weight = (1 + 0.3 * torch.randn(d)).to(torch.bfloat16)
    k_weight = (1 + 0.3 * torch.randn(d)).to(torch.bfloat16)
    before = qkv.clone()
    table_qk_norm_rope_cpu(qkv, positions, q_weight, k_weight, table, hq, hk, d, 1e-6)
    expected = reference(before, positions, q_weight, k_weight, table, hq, hk, d, 1e-6)
    qk = (hq + hk) * d
    assert torch.equal(qkv[:, qk:], before[:, qk:])  # v untouched
    error = (qkv[:, :qk].double() - expected[:, :qk]).abs().max()
    assert error < 0.05, error  # two bfloat16 roundings of values up to ~4
    assert (qkv[0, :qk].double() - expected[0, :qk]).abs().max() < 0.05  # position 0: a plain RMSNorm
    with pytest.raises(TypeError, match="q_weight must be bfloat16, got torch.float32"):
        table_qk_norm_rope_cpu(qkv, positions, q_weight.float(), k_weight, table, hq, hk, d, 1e-6)
