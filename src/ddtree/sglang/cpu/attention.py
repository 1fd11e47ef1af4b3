"""`--attention-backend ddtree_cpu`: SGLang's torch_native backend plus TARGET_VERIFY, the
one mode DFlash and DDTree need that torch_native lacks, for the CPU test server.

Why a backend of our own: SGLang 0.5.23 on CPU has no attention backend that applies a
custom (tree) mask. torch_native handles only extend and decode (srt/layers/attention/
torch_native_backend.py:279-398; TARGET_VERIFY carries no extend_prefix_lens for it), and
the Triton backend, run in Triton's CPU interpreter, computes garbage in bfloat16 (numpy
has no bfloat16), which DFlash forces: the drafter's input embeddings are cast to bfloat16
whatever --dtype says (srt/model_executor/model_runner.py:1772).

Decode and TARGET_VERIFY both go through attend_each_row, so a verified tree node is
computed with the same calls as a plain decode of that token. TARGET_VERIFY here is what SGLang's Triton backend computes for it
(triton_backend.py:1007-1062 metadata, extend_attention_fwd with
skip_prefix_custom_mask=True): each request's window of W query tokens attends to its
whole committed prefix (req_to_token[req, :seq_len]) and to the window's own keys, by the
custom mask when one is given ([W, seq_len + W] row-major per request, the window columns
read), else causally, or fully for ENCODER_ONLY layers (the DFlash drafter).
tests/sglang_server/test_cpu_parity.py checks it against the Triton kernel in the
interpreter on float32 inputs. Where SGLang falls back to causal attention when a verify
brings no mask, this refuses whenever the DDTree plugin is enabled (require_tree_mask): a
plugin fault must fail the CPU server, not hide in it.
"""
from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ddtree.sglang.cpu.tree_mask_guard import ddtree_trees_expected, require_tree_mask

BACKEND_NAME = "ddtree_cpu"


def window_visibility(
    custom_mask: torch.Tensor | None,  # [sum_b W*(prefix_b+W)] bool, or None
    mask_offset: int,  # where request b's rows start in custom_mask
    prefix_len: int,
    width: int,
    causal: bool,
) -> torch.Tensor:
    """[W, prefix + W] bool: which keys each window query sees."""
    visible = torch.ones((width, prefix_len + width), dtype=torch.bool)
    if custom_mask is not None:
        rows = custom_mask[mask_offset: mask_offset + width * (prefix_len + width)]
        visible[:, prefix_len:] = rows.view(width, prefix_len + width)[:, prefix_len:].to(torch.bool)
    elif causal:
        visible[:, prefix_len:] = torch.ones((width, width), dtype=torch.bool).tril()
    return visible


def attend_each_row(
    queries: torch.Tensor,  # [W, Hq, D]
    keys: torch.Tensor,  # [L, Hkv, D] in position order
    values: torch.Tensor,  # [L, Hkv, Dv]
    visible: torch.Tensor,  # [W, L] bool
    scaling: float,
) -> torch.Tensor:
    """[W, Hq, Dv]. One SDPA call per query over exactly the keys it sees, the call a
    one-token decode makes: a tree node then gets the bits a plain decode of the same token
    would (masked-out keys would still change the kernel's blocking, and with it the
    bfloat16 rounding that decides close argmaxes)."""
    out = queries.new_empty((queries.shape[0], queries.shape[1], values.shape[-1]))
    enable_gqa = queries.shape[1] != keys.shape[1]
    for row in range(queries.shape[0]):
        seen = visible[row].nonzero().squeeze(1)
        out[row] = scaled_dot_product_attention(
            queries[row].unsqueeze(1).unsqueeze(0),  # [1, Hq, 1, D]
            keys[seen].movedim(0, 1).unsqueeze(0),  # [1, Hkv, l, D]
            values[seen].movedim(0, 1).unsqueeze(0),
            scale=scaling,
            enable_gqa=enable_gqa,
        )[0, :, 0]
    return out


def target_verify_attention(
    q: torch.Tensor,  # [bs*W, Hq, D]
    k_window: torch.Tensor,  # [bs*W, Hkv, D]
    v_window: torch.Tensor,  # [bs*W, Hkv, Dv]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    req_to_token: torch.Tensor,  # [reqs, context] int
    req_pool_indices: torch.Tensor,  # [bs] int
    prefix_lens: torch.Tensor,  # [bs] int committed tokens
    custom_mask: torch.Tensor | None,  # [sum_b W*(prefix_b+W)] bool, or None
    causal: bool,
    scaling: float,
) -> torch.Tensor:
    """[bs*W, Hq, Dv]: per request, attention over prefix + window keys under the window mask."""
    bs = int(req_pool_indices.shape[0])
    width = q.shape[0] // bs
    out = q.new_empty((q.shape[0], q.shape[1], v_window.shape[-1]))
    mask_offset = 0
    for b in range(bs):
        prefix = int(prefix_lens[b])
        rows = slice(b * width, (b + 1) * width)
        slots = req_to_token[int(req_pool_indices[b]), :prefix].to(torch.int64)
        keys = torch.cat([k_cache[slots].to(q.dtype), k_window[rows].to(q.dtype)])  # [prefix+W, Hkv, D]
        values = torch.cat([v_cache[slots].to(q.dtype), v_window[rows].to(q.dtype)])
        visible = window_visibility(custom_mask, mask_offset, prefix, width, causal).to(q.device)
        mask_offset += width * (prefix + width)
        out[rows] = attend_each_row(q[rows], keys, values, visible, scaling)
    return out


def decode_attention(
    q: torch.Tensor,  # [bs, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] keys per request, the new token's included
    scaling: float,
) -> torch.Tensor:
    """[bs, Hq, Dv]: one token per request over its whole context, by attend_each_row."""
    out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
    for b in range(q.shape[0]):
        slots = req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].to(torch.int64)
        visible = torch.ones((1, slots.numel()), dtype=torch.bool, device=q.device)
        out[b: b + 1] = attend_each_row(
            q[b: b + 1], k_cache[slots].to(q.dtype), v_cache[slots].to(q.dtype), visible, scaling
        )
    return out


def plain_self_attention(layer) -> bool:
    """No cross-attention, sliding window or logit cap: what attend_each_row computes."""
    return not layer.is_cross_attention and (layer.sliding_window_size or -1) <= -1 and not layer.logit_cap


class DDTreeCpuAttnBackend(TorchNativeAttnBackend):
    """Extend (prefill) is torch_native's; decode and target verify share attend_each_row."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._trees_expected = ddtree_trees_expected()

    def _store_kv(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )

    def _caches(self, layer):
        return (self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not plain_self_attention(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self._store_kv(layer, forward_batch, k, v, save_kv_cache)
        out = decode_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), *self._caches(layer),
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            layer.scaling,
        )
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if not plain_self_attention(layer):
            raise NotImplementedError(
                f"{BACKEND_NAME}: target verify supports plain self-attention only (layer {layer.layer_id})"
            )
        custom_mask = getattr(forward_batch.spec_info, "custom_mask", None)
        causal = layer.attn_type != AttentionType.ENCODER_ONLY  # the DFlash drafter's block sees itself whole
        require_tree_mask(custom_mask, causal=causal, trees_expected=self._trees_expected, layer_id=layer.layer_id,
                          width=q.shape[0] // max(1, int(forward_batch.req_pool_indices.shape[0])))
        self._store_kv(layer, forward_batch, k, v, save_kv_cache)
        out = target_verify_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            k.view(-1, layer.tp_k_head_num, layer.qk_head_dim),
            v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
            *self._caches(layer),
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            custom_mask, causal, layer.scaling,
        )
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def create_ddtree_cpu_backend(model_runner):
    return DDTreeCpuAttnBackend(model_runner)
