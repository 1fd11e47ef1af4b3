"""SGLang 0.5.23's own Triton kernels, fed the inputs DDTree gives them, run in Triton's CPU
interpreter (TRITON_INTERPRET=1). Each kernel file is loaded straight from the real wheel.

Out-of-bounds reads are made visible with canaries: every table a kernel reads lives at the
front of a larger NaN-filled buffer, so a read past its end poisons the output instead of
silently returning whatever memory follows."""
from __future__ import annotations

import importlib.util
import os

# Triton reads this when it is first imported, and SGLang's kernels must all be interpreted:
# nothing else in the CPU suite uses Triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from ddtree.sglang.tree_round import front_positions  # noqa: E402
from sglang_plugin.dist import sglang_package_dir  # noqa: E402

pytest.importorskip("triton", reason="the Triton interpreter runs SGLang's kernels on CPU (test extra)")


def load_sglang_kernel_module(relative: str):
    """A fresh module object for an SGLang file, its @triton.jit kernels built for the interpreter."""
    path = sglang_package_dir() / relative
    spec = importlib.util.spec_from_file_location(f"sglang_kernel_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_nan_canary(table: torch.Tensor, spare_rows: int) -> torch.Tensor:
    """`table` as a view onto the front of a buffer whose further rows are NaN."""
    buffer = torch.full((table.shape[0] + spare_rows, *table.shape[1:]), float("nan"), dtype=table.dtype)
    buffer[: table.shape[0]] = table
    return buffer[: table.shape[0]]


def neox_rope_reference(k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """k: [T, heads, D] float32, cos_sin: [P, D] (cos | sin halves), positions: [T] -> roped k."""
    half = k.shape[-1] // 2
    cos = cos_sin[positions, :half].unsqueeze(1)
    sin = cos_sin[positions, half:].unsqueeze(1)
    first, second = k[..., :half], k[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.mark.parametrize("prefix", [[31], [31, 28, 5], [27, 31]])
def test_draft_kv_rewrite_stays_inside_dflashs_rope_table(prefix):
    """DFlashWorkerV2 sizes the fused draft-KV RoPE table for context_len + B
    (max_position_hint, dflash_worker_v2.py:1074-1075; fused_kv_materialize.py:415-425), and the
    kernel ropes every row it is given, committed or not. DDTree hands it the N-wide window:
    with requests at the end of the context, every row's position must stay in the table, and
    the committed rows (j < commit_len <= B) must be roped at prefix + j."""
    fused = load_sglang_kernel_module("kernels/ops/speculative/fused_kv_materialize.py")
    context_len, block, width = 32, 4, 9  # B = 4, N = 9 > B
    layers, heads, head_dim = 2, 2, 8
    prefix_lens = torch.tensor(prefix, dtype=torch.int64)
    positions = front_positions(prefix_lens, width, block)  # [bs*N]
    rows = positions.numel()
    gen = torch.Generator().manual_seed(3)
    cos_sin = with_nan_canary(torch.randn(context_len + block, head_dim, generator=gen), spare_rows=width)
    kv = torch.randn(rows, layers, 2 * heads * head_dim, generator=gen)
    norm_weight = torch.ones(layers, head_dim)
    eps = torch.full((layers,), 1e-6)

    k_out, v_out = fused._fused_norm_rope_stacked(kv, norm_weight, eps, cos_sin, positions, heads, head_dim, head_dim)

    assert torch.isfinite(k_out).all(), "a row read past the RoPE table (NaN canary reached the output)"
    k_raw = kv[:, 0, : heads * head_dim].view(rows, heads, head_dim)
    k_normed = k_raw * torch.rsqrt(k_raw.pow(2).mean(-1, keepdim=True) + 1e-6)
    exact = torch.arange(rows) % width < block  # rows a round can commit
    expected = neox_rope_reference(k_normed[exact], cos_sin, (prefix_lens.repeat_interleave(width) + torch.arange(rows) % width)[exact])
    torch.testing.assert_close(k_out[0][exact], expected, rtol=1e-5, atol=1e-5)
