"""The CPU server's own parts against SGLang's Triton kernels for the same jobs, run in
Triton's CPU interpreter inside the CPU server environment: the sgl_kernel stand-in ops
(bit for bit), the ddtree_cpu attention backend (float32, to rounding) and the drafter's fused
QK-norm + RoPE stand-in (bit for bit, with the interpreter's truncating bfloat16 casts)."""
from __future__ import annotations

from pathlib import Path

import pytest

from .cpu_server import cpu_env_python, run_in_env

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_cpu_kernels_match_sglang_triton_kernels():
    cases = run_in_env(cpu_env_python(), HERE / "kernel_parity.py")
    names = {case["case"].split(" seed")[0] for case in cases}
    assert names == {"assign_req_to_token_pool", "assign_extend_cache_locs", "assign_draft_cache_locs_contiguous",
                     "fill_bonus_tokens", "fill_accept_out_cache_loc", "copy_all_layer_kv_cache", "verify_tree_greedy"}
    differing = [f"{case['case']}: {case['detail']}" for case in cases if not case["equal"]]
    assert not differing, "\n".join(differing)


def test_ddtree_cpu_attention_matches_sglang_triton_attention():
    cases = run_in_env(cpu_env_python(), HERE / "attention_parity.py")
    spread = cases.pop()
    assert spread["mask_spread"] > 1e-2, "the tree, causal and non-causal cases do not exercise different masks"
    assert len(cases) == 12
    worst = max(cases, key=lambda case: case["max_abs_diff"])
    assert worst["max_abs_diff"] < 1e-5, worst


def test_fused_rope_standin_matches_sglang_triton_kernel():
    cases = run_in_env(cpu_env_python(), HERE / "rope_parity.py")
    assert len(cases) == 10
    assert all(case["qk_changed"] and case["v_kept"] for case in cases), cases
    differing = [case for case in cases if not case["equal"]]
    assert not differing, differing
    # Served (rounded to nearest, as compiled) vs the interpreter's truncating casts: the two
    # bfloat16 casts apart, never more (a bfloat16 step is 2^-7 of a head's largest value).
    assert any(case["rounded_differs"] for case in cases)
    assert max(case["rounded_max_head_diff"] for case in cases) <= 3 * 2 ** -7
