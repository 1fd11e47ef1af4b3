"""A CPU stand-in for SGLang's fused Triton kernel `table_qk_norm_rope_`, for the CPU test server.

A NeoX-RoPE DFlash drafter (every published one) runs that kernel on each block forward on
every non-NPU device (srt/models/dflash.py:283-289 choose it, :383-397 call it). Triton's CPU
interpreter runs it one program per (token, head): about 4 s a round on the tiny drafter, too
slow to serve with. This does the same job in a few torch ops and the CPU server's plugin puts
it in the kernel's place (ddtree.sglang.cpu.server_plugin, a HookRegistry REPLACE; dflash.py
imports the kernel at call time, so it finds the replacement).

What the kernel does (kernels/ops/attention/table_qk_norm_rope.py:6-48), per token and per q
or k head of the fused qkv row, in place: RMS-normalise the head in float32, scale by the
norm's weight read as bfloat16, round to bfloat16, rotate the two halves (NeoX) by the cos/sin
row of the token's position in the rotary table (float32), store bfloat16. V is untouched.
The kernel's `.to(tl.bfloat16)` rounds to nearest even when compiled (an fptrunc,
triton/language/semantic.py:896-901, Triton 3.9), and so does this. Triton's interpreter
instead truncates: its fptrunc is `cast_impl` (triton/runtime/interpreter.py:572), which
passes no rounding mode to `_convert_float` (:557-563, :189-226). So the parity test
(tests/sglang_server/rope_parity.py) asks this for the interpreter's truncation and then
finds the two equal bit for bit: the sum of squares is added here in the order numpy's
pairwise sum uses, which is what the interpreter runs (a compiled kernel adds in its own order,
a last-bit float32 difference before the bfloat16 rounding).
"""
from __future__ import annotations

import torch

_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE
_UNROLL = 8


def pairwise_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in numpy's pairwise order (float32 add.reduce on a contiguous row):
    below 8 elements one by one; up to 128, eight running sums combined as a tree, then the rest;
    above, the two halves (the first a multiple of 8) recursively. [..., n] -> [...]."""
    n = values.shape[-1]
    if n < _UNROLL:
        total = values[..., 0]
        for i in range(1, n):
            total = total + values[..., i]
        return total
    if n <= _PAIRWISE_BLOCK:
        lanes = values[..., 0:_UNROLL]
        whole = n - n % _UNROLL
        for start in range(_UNROLL, whole, _UNROLL):
            lanes = lanes + values[..., start: start + _UNROLL]
        r = [lanes[..., j] for j in range(_UNROLL)]
        total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for i in range(whole, n):
            total = total + values[..., i]
        return total
    half = n // 2
    half -= half % _UNROLL
    return pairwise_sum(values[..., :half]) + pairwise_sum(values[..., half:])


def to_bfloat16(values: torch.Tensor, truncate: bool) -> torch.Tensor:
    """float32 -> bfloat16 values (as float32): rounded to nearest even, or toward zero."""
    if not truncate:
        return values.to(torch.bfloat16).float()
    return (values.contiguous().view(torch.int32) & -65536).view(torch.float32)  # keep the top 16 bits


def table_qk_norm_rope_cpu(
    qkv: torch.Tensor,  # [T, (Hq + 2 * Hk) * D] bfloat16, written in place (q and k columns)
    positions: torch.Tensor,  # [T] int
    q_weight: torch.Tensor,  # [D] bfloat16 q_norm weight
    k_weight: torch.Tensor,  # [D] bfloat16 k_norm weight
    cos_sin_cache: torch.Tensor,  # [max_position, D]: cos of the D/2 frequencies, then sin
    num_q_heads: int,
    num_k_heads: int,
    head_dim: int,
    eps: float,
    *,
    truncate_bf16: bool = False,  # cast as Triton's interpreter does (the parity test only)
) -> None:
    """In-place QK RMSNorm + NeoX RoPE from the rotary table, as the Triton kernel computes it."""
    if qkv.shape[0] == 0:
        return
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.dtype != torch.bfloat16:  # the kernel reads the weights as bfloat16 whatever they are
            raise TypeError(f"table_qk_norm_rope: {name} must be bfloat16, got {weight.dtype}")
    half = head_dim // 2
    heads = num_q_heads + num_k_heads
    rows = qkv[:, : heads * head_dim].unflatten(1, (heads, head_dim))  # [T, Hq + Hk, D], a view of qkv
    x = rows.float()
    inv = 1.0 / torch.sqrt(pairwise_sum(x * x) / head_dim + eps)  # [T, heads]
    weight = torch.cat([q_weight.expand(num_q_heads, head_dim), k_weight.expand(num_k_heads, head_dim)]).float()
    normed = to_bfloat16(x * inv.unsqueeze(-1) * weight, truncate_bf16)  # [T, heads, D]
    x1, x2 = normed[..., :half], normed[..., half:]
    table = cos_sin_cache[positions.long()].float()  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:head_dim]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    rows.copy_(to_bfloat16(rotated, truncate_bf16))
