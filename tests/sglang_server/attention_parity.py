"""Run inside the CPU server environment: ddtree.sglang.cpu.attention (the ddtree_cpu
backend's target-verify and decode attention) against SGLang 0.5.23's Triton kernels the
Triton backend uses for them (extend_attention_fwd, decode_attention_fwd), interpreted on
CPU, on the same float32 inputs: tree masks as DDTree builds them, DFlash's causal chain and
the drafter's non-causal block. Prints one JSON line of cases with the max abs difference."""
from __future__ import annotations

import json
import random

import torch

from ddtree.sglang.cpu.attention import decode_attention, target_verify_attention
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

HQ, HKV, D = 4, 2, 16
results = []


def tree_mask(rng: random.Random, width: int) -> torch.Tensor:
    """[W, W] ancestor-or-self visibility of a random tree (node 0 the root)."""
    parents = [-1] + [rng.randrange(0, i) for i in range(1, width)]
    visible = torch.zeros((width, width), dtype=torch.bool)
    for node in range(width):
        walk = node
        while walk != -1:
            visible[node, walk] = True
            walk = parents[walk]
    return visible


def case(seed: int, kind: str) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, width = rng.randint(1, 4), rng.randint(2, 9)
    prefix = torch.tensor([rng.randint(1, 20) for _ in range(bs)], dtype=torch.int64)
    slots = 256
    k_cache, v_cache = torch.randn(slots, HKV, D), torch.randn(slots, HKV, D)
    req_to_token = torch.zeros((bs + 2, 64), dtype=torch.int32)
    req_pool = torch.tensor(rng.sample(range(bs + 2), bs), dtype=torch.int64)
    free = iter(torch.randperm(slots).tolist())
    for b in range(bs):
        req_to_token[req_pool[b], : prefix[b]] = torch.tensor([next(free) for _ in range(int(prefix[b]))])
    q = torch.randn(bs * width, HQ, D)
    k_new, v_new = torch.randn(bs * width, HKV, D), torch.randn(bs * width, HKV, D)
    masks, custom = [], None
    if kind == "tree":
        for b in range(bs):
            full = torch.ones((width, int(prefix[b]) + width), dtype=torch.bool)
            full[:, int(prefix[b]):] = tree_mask(rng, width)
            masks.append(full.reshape(-1))
        custom = torch.cat(masks).to(torch.uint8)
    causal = kind != "encoder-only"
    scale = D ** -0.5
    ours = target_verify_attention(q, k_new, v_new, k_cache, v_cache, req_to_token, req_pool, prefix,
                                   custom, causal, scale)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(prefix, 0)
    kv_indices = torch.cat([req_to_token[req_pool[b], : prefix[b]].to(torch.int64) for b in range(bs)])
    qo_indptr = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32)
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
    mask_indptr[1:] = torch.cumsum(width * (prefix + width), 0)
    theirs = torch.empty_like(q)
    extend_attention_fwd(q, k_new, v_new, theirs, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                         custom, causal, mask_indptr, width, 1.0, 1.0, sm_scale=scale)
    diff = float((ours - theirs).abs().max())
    results.append({"case": f"target verify {kind} seed {seed} (bs {bs}, width {width})", "max_abs_diff": diff})
    return ours


def decode_case(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, slots = rng.randint(1, 5), 256
    lens = torch.tensor([rng.randint(1, 40) for _ in range(bs)], dtype=torch.int64)
    k_cache, v_cache = torch.randn(slots, HKV, D), torch.randn(slots, HKV, D)
    req_to_token = torch.zeros((bs, 64), dtype=torch.int32)
    for b in range(bs):
        req_to_token[b, : lens[b]] = torch.randperm(slots)[: int(lens[b])].to(torch.int32)
    q = torch.randn(bs, HQ, D)
    scale = D ** -0.5
    ours = decode_attention(q, k_cache, v_cache, req_to_token, torch.arange(bs), lens, scale)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    kv_indices = torch.cat([req_to_token[b, : lens[b]].to(torch.int64) for b in range(bs)])
    splits = 4
    logits = torch.empty((bs, HQ, splits, D), dtype=torch.float32)
    lse = torch.empty((bs, HQ, splits), dtype=torch.float32)
    theirs = torch.empty_like(q)
    decode_attention_fwd(q, k_cache, v_cache, theirs, kv_indptr, kv_indices, logits, lse,
                         torch.full((bs,), splits, dtype=torch.int32), splits, scale, 1.0, 1.0)
    results.append({"case": f"decode seed {seed} (bs {bs})", "max_abs_diff": float((ours - theirs).abs().max())})


# The three masks must give different answers on the same inputs, or the cases above
# could not tell a backend that ignores the mask from one that applies it.
# (A small random tree can be a chain, so each pair need differ on some seed, not all.)
PAIRS = (("tree", "causal"), ("tree", "encoder-only"), ("causal", "encoder-only"))
spread = dict.fromkeys(PAIRS, 0.0)
for seed in range(3):
    by_kind = {kind: case(seed, kind) for kind in ("tree", "causal", "encoder-only")}
    for a, b in PAIRS:
        spread[(a, b)] = max(spread[(a, b)], float((by_kind[a] - by_kind[b]).abs().max()))
    decode_case(seed)
results.append({"case": "outputs of two masks differ", "mask_spread": min(spread.values())})
print(json.dumps(results))
