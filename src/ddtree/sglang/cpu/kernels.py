"""Pure-torch versions of the `sgl_kernel` CPU ops that SGLang 0.5.23 imports under its CPU
engine (SGLANG_USE_CPU_ENGINE=1), for the CPU test server only.

SGLang's CPU kernels ship in a CPU build of sgl-kernel that is not on PyPI (the registry's
sglang-kernel 0.4.10 links libcudart). Each op below does what SGLang's own Triton kernel of
the same job does (file:line of that kernel in each docstring, paths under sglang/);
tests/sglang_server/test_cpu_parity.py runs both on the same inputs, the Triton one in
Triton's CPU interpreter. Argument names and order follow SGLang's CPU call sites, which
pass them positionally or by these names. Loops over the batch are plain Python: these run
on test-sized batches, where clarity beats speed.
"""
from __future__ import annotations

import ctypes

import torch


def _out_offsets(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[int]:
    """Where request b's run starts in the packed output: sum of the lengths before it."""
    lengths = (end_offset.to(torch.int64) - start_offset.to(torch.int64)).tolist()
    offsets, total = [], 0
    for length in lengths:
        offsets.append(total)
        total += length
    return offsets


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [bs] int
    req_to_token: torch.Tensor,  # [pool, pool_len] int32, written
    start_offset: torch.Tensor,  # [bs] int
    end_offset: torch.Tensor,  # [bs] int
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = the request's run of out_cache_loc
    (srt/mem_cache/allocation.py:692-723)."""
    del pool_len  # the row length is req_to_token's own
    offsets = _out_offsets(start_offset, end_offset)
    for b, req in enumerate(req_pool_indices.tolist()):
        start, end = int(start_offset[b]), int(end_offset[b])
        req_to_token[req, start:end] = out_cache_loc[offsets[b]: offsets[b] + end - start].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,  # [bs] int
    req_to_token: torch.Tensor,  # [pool, pool_len] int
    start_offset: torch.Tensor,  # [bs] int
    end_offset: torch.Tensor,  # [bs] int
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int, written
    pool_len: int,
) -> None:
    """The inverse gather: out_cache_loc's run for request b = req_to_token[req, start:end]
    (kernels/ops/speculative/cache_locs.py:500-532)."""
    del pool_len
    offsets = _out_offsets(start_offset, end_offset)
    for b, req in enumerate(req_pool_indices.tolist()):
        start, end = int(start_offset[b]), int(end_offset[b])
        out_cache_loc[offsets[b]: offsets[b] + end - start] = req_to_token[req, start:end].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,  # [bs] int
    req_to_token: torch.Tensor,  # [pool, pool_len] int
    seq_lens: torch.Tensor,  # [bs] int
    out_cache_loc: torch.Tensor,  # [bs * topk * num_cols] int, written
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Each request's topk*num_cols slots from seq_lens on, back to back
    (kernels/ops/speculative/cache_locs.py:43-82, positions not written on CPU)."""
    del pool_len
    width = topk * num_cols
    for b, req in enumerate(req_pool_indices.tolist()):
        start = int(seq_lens[b])
        out_cache_loc[b * width: (b + 1) * width] = req_to_token[req, start: start + width].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,  # [bs, stride] (or flat) int
    accept_lens: torch.Tensor,  # [bs] int, bonus included
    bonus_tokens: torch.Tensor,  # [bs] int, written
    accept_stride: int,
) -> None:
    """bonus[b] = the last accepted token of request b (kernels/ops/speculative/eagle.py:14-29)."""
    flat = accept_tokens.reshape(-1)
    rows = torch.arange(accept_lens.shape[0], dtype=torch.int64) * accept_stride
    bonus_tokens.copy_(flat[rows + accept_lens.to(torch.int64) - 1].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,  # [bs, width] (or flat) int, -1 = not accepted
    out_cache_loc: torch.Tensor,  # [bs * N] int
    accept_out_cache_loc: torch.Tensor,  # [>= accepted] int, written
) -> None:
    """The cache slots of the accepted rows, packed in row order
    (kernels/ops/speculative/eagle.py:56-70)."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].to(torch.int64)
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [buffers] int64 addresses of each layer's K or V buffer
    strides: torch.Tensor,  # [buffers] int64 bytes per cache slot in that buffer
    tgt_loc: torch.Tensor,  # [n] int
    src_loc: torch.Tensor,  # [n] int
) -> None:
    """For every buffer, slot tgt_loc[i] takes the bytes of slot src_loc[i]; all sources are
    read before any target is written, so overlapping moves are safe
    (kernels/ops/kvcache/cache_move.py:146-178). SGLang hands over raw addresses, so each
    buffer is viewed through ctypes, only as far as the highest slot touched."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(address)
        slots = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        slots[tgt] = slots[src].clone()


def verify_tree_greedy_cpu(
    *,
    predicts: torch.Tensor,  # [bs*N] int32, written
    accept_index: torch.Tensor,  # [bs, S] int32, written
    accept_token_num: torch.Tensor,  # [bs] int32, written (drafts accepted, root excluded)
    candidates: torch.Tensor,  # [bs, N] int draft tokens, root first
    retrive_index: torch.Tensor,  # [bs, N] int flat row of each node
    retrive_next_token: torch.Tensor,  # [bs, N] int first child, -1 none
    retrive_next_sibling: torch.Tensor,  # [bs, N] int next sibling, -1 none
    target_predict: torch.Tensor,  # [bs, N] int target argmax per node
) -> None:
    """Greedy walk from the root: at each level take the first child whose token equals the
    target's prediction at the last accepted node; stop when none does. Writes the target's
    token at each accepted node and the bonus at the last (the walk of
    kernels/ops/speculative/spec_tree.py:211-314)."""
    num_spec = accept_index.shape[1]
    flat_target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted = 0
        node = 0
        for _level in range(1, num_spec):
            node = int(retrive_next_token[b, node])
            target_token = int(flat_target[last])
            while node != -1 and int(candidates[b, node]) != target_token:
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
            predicts[last] = target_token
            accepted += 1
            last = int(retrive_index[b, node])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


def build_tree_kernel_efficient_cpu(*args, **kwargs) -> None:
    raise NotImplementedError(
        "ddtree's CPU stand-in for sgl_kernel has no build_tree_kernel_efficient_cpu: it builds "
        "EAGLE trees, which the DDTree CPU test server never runs"
    )


def rotate_input_ids_cpu(*args, **kwargs) -> None:
    raise NotImplementedError(
        "ddtree's CPU stand-in for sgl_kernel has no rotate_input_ids_cpu: it serves multi-layer "
        "EAGLE, which the DDTree CPU test server never runs"
    )
