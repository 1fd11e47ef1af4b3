"""Run inside the CPU server environment: ddtree.sglang.cpu.fused_rope (the CPU stand-in for the
fused QK-norm + NeoX RoPE kernel of a DFlash drafter) against SGLang 0.5.23's Triton kernel
`table_qk_norm_rope_`, interpreted on CPU, on the same bfloat16 fused qkv rows, with the rotary
table SGLang's own RotaryEmbedding builds (bfloat16 as the CPU server keeps it, and float32 as
a GPU does). Prints one JSON line of cases: whether the two results are equal bit for bit,
and that the kernel changed the q/k columns and left v alone."""
from __future__ import annotations

import json
import random

import torch

from ddtree.sglang.cpu.fused_rope import table_qk_norm_rope_cpu
from sglang.kernels.ops.attention.table_qk_norm_rope import table_qk_norm_rope_
from sglang.srt.layers.rotary_embedding import get_rope

results = []
for seed in range(10):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    head_dim = rng.choice([16, 32, 64, 128, 256])
    hq = rng.choice([1, 2, 4])
    hk = rng.choice([h for h in (1, 2, 4) if hq % h == 0])
    tokens = rng.randint(1, 6)
    cache_dtype = torch.bfloat16 if seed % 2 == 0 else torch.float32
    rope = get_rope(head_dim, rotary_dim=head_dim, max_position=512, base=rng.choice([10000.0, 1e6]),
                    is_neox_style=True, dtype=cache_dtype)
    width = (hq + 2 * hk) * head_dim
    qkv = (torch.randn(tokens, width) * rng.choice([0.5, 3.0])).to(torch.bfloat16)
    positions = torch.tensor([rng.randrange(0, 512) for _ in range(tokens)], dtype=torch.int64)
    q_weight = (1 + 0.2 * torch.randn(head_dim)).to(torch.bfloat16)
    k_weight = (1 + 0.2 * torch.randn(head_dim)).to(torch.bfloat16)
    eps = rng.choice([1e-6, 1e-5])
    theirs, ours = qkv.clone(), qkv.clone()
    args = (q_weight, k_weight, rope.cos_sin_cache, hq, hk, head_dim, eps)
    table_qk_norm_rope_(theirs, positions, *args)
    table_qk_norm_rope_cpu(ours, positions, *args, truncate_bf16=True)
    served = qkv.clone()  # what the CPU server computes: bfloat16 rounded to nearest, as compiled
    table_qk_norm_rope_cpu(served, positions, *args)
    qk = (hq + hk) * head_dim
    heads_served = served[:, :qk].float().unflatten(1, (hq + hk, head_dim))
    heads_theirs = theirs[:, :qk].float().unflatten(1, (hq + hk, head_dim))
    # per head: the largest difference in units of the head's largest value (a bfloat16 step is 2^-7 of it)
    spread = ((heads_served - heads_theirs).abs().amax(-1) / heads_theirs.abs().amax(-1)).max()
    results.append({
        "case": f"table_qk_norm_rope seed {seed} (T {tokens}, Hq {hq}, Hk {hk}, D {head_dim}, cache {cache_dtype})",
        "equal": bool(torch.equal(theirs.view(torch.int16), ours.view(torch.int16))),
        "differing_elements": int((theirs.view(torch.int16) != ours.view(torch.int16)).sum()),
        "rounded_max_head_diff": float(spread),  # nearest vs truncated casts: a few bfloat16 steps
        "rounded_differs": bool((served != theirs).any()),
        "qk_changed": bool((theirs[:, :qk] != qkv[:, :qk]).any()),
        "v_kept": bool(torch.equal(theirs[:, qk:], qkv[:, qk:])),
    })
print(json.dumps(results))
