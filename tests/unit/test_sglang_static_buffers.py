"""The target's N-wide verify graph buffers: sized as the real SGLang 0.5.23 files size them,
and refused at startup with the numbers when they cannot fit."""
from __future__ import annotations

import re

import pytest

from ddtree.sglang.errors import UnsupportedSetupError
from ddtree.sglang.support import check_verify_buffers_fit, verify_graph_buffers
from sglang_plugin.dist import sglang_package_dir

GIB = 1 << 30


def _source(relative: str) -> str:
    return (sglang_package_dir() / relative).read_text()


def test_the_sizes_are_sglangs():
    """The formulas in verify_graph_buffers, read back from the 0.5.23 sources."""
    runner = _source("srt/model_executor/runner/decode_cuda_graph_runner.py")
    assert "else self.max_bs * self.captured_req_width" in runner  # max_num_token = max_bs * N
    assert "self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)" in runner
    base = _source("srt/model_executor/runner/base_runner.py")
    assert re.search(r"torch\.zeros\(\s*\(max_num_token, vocab_size\),\s*dtype=torch\.float,", base)
    flashinfer = _source("srt/layers/attention/flashinfer_backend.py")
    assert re.search(r"cuda_graph_kv_indices = torch\.zeros\(\s*\(max_num_tokens \* self\.max_context_len,\),"
                     r"\s*dtype=torch\.int32,", flashinfer)
    assert re.search(r"self\.cuda_graph_custom_mask = torch\.zeros\(\s*\(max_num_tokens \* self\.max_context_len\),"
                     r"\s*dtype=torch\.uint8,", flashinfer)
    triton = _source("srt/layers/attention/triton_backend.py")
    assert re.search(r"self\.cuda_graph_kv_indices = torch\.zeros\(\s*\(max_num_tokens \* self\.max_context_len\),"
                     r"\s*dtype=torch\.int64,", triton)
    mask = _source("srt/layers/attention/verify_mask.py")
    assert "per_req = num_draft_tokens * (max_context_len + num_draft_tokens)" in mask and "return bs * per_req" in mask


@pytest.mark.parametrize("backend, extra", [
    ("FlashInferAttnBackend", 48 * 257 * 131072 * 4 + 48 * 257 * 131072),
    ("TritonAttnBackend", 48 * 257 * 131072 * 8 + 48 * 257 * (131072 + 257)),
])
def test_a_budget_whose_graph_buffers_cannot_fit_is_refused_with_the_numbers(backend, extra):
    buffers = verify_graph_buffers(backend_class=backend, max_bs=48, width=257, vocab_size=152064, context_len=131072)
    logits = 48 * 257 * 152064 * 4  # 7.5 GB: [max_bs*N, V] fp32
    assert buffers[0].nbytes == logits and sum(b.nbytes for b in buffers) == logits + extra
    total = logits + extra
    check_verify_buffers_fit(buffers, free_bytes=total, budget=256, max_bs=48, context_len=131072)  # fits exactly
    with pytest.raises(UnsupportedSetupError) as refused:
        check_verify_buffers_fit(buffers, free_bytes=total - 1, budget=256, max_bs=48, context_len=131072)
    message = str(refused.value)
    assert f"need {total / GIB:.2f} GiB" in message and "graph logits [max_bs*N=12336, V=152064] fp32 = 6.99 GiB" in message
    assert "DDTREE_BUDGET (256, N = 257)" in message and "--cuda-graph-max-bs (48)" in message
    assert "--context-length (131072)" in message and "\n" not in message


def test_the_worker_refuses_before_any_graph_is_captured():
    """Scheduler order (scheduler.py:1128-1146): workers built, KV pools, attention backends
    (target, then ours), then CUDA graphs (target, then ours). Our init_attention_backends is
    the last hook before the target's capture: the check runs there, before the drafter's."""
    import ast
    from pathlib import Path

    from ddtree.sglang.manifest import find_definition

    scheduler = _source("srt/managers/scheduler.py")
    order = [scheduler.index(s) for s in ("self.maybe_init_draft_worker()", "self.init_memory_pools()",
                                          "self.init_all_attention_backends()", "self.init_all_cuda_graphs()")]
    assert order == sorted(order)
    worker = ast.parse((Path(__file__).resolve().parents[2] / "src/ddtree/sglang/worker.py").read_text())
    method = find_definition(worker, "DDTreeWorkerV2.init_attention_backends")
    first = method.body[0].value
    assert ast.unparse(first) == "self._refuse_unsupported_target_verify()"
    check = ast.unparse(find_definition(worker, "DDTreeWorkerV2._refuse_unsupported_target_verify"))
    assert "check_verify_buffers_fit(" in check and "torch.cuda.mem_get_info(self.device)" in check
