"""Run inside the CPU server environment (SGLANG_USE_CPU_ENGINE=1, TRITON_INTERPRET=1):
each pure-torch op of ddtree.sglang.cpu.kernels against SGLang 0.5.23's own Triton kernel of
the same job, interpreted on CPU, on the same seeded inputs. Prints one JSON line:
[{"case": ..., "equal": bool, "detail": ...}, ...]. Used by test_cpu_parity.py."""
from __future__ import annotations

import json
import random

import torch

from ddtree.sglang.cpu import kernels as ours
from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled
from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs
from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
from sglang.srt.utils import next_power_of_2

results = []


def record(case: str, a: torch.Tensor, b: torch.Tensor) -> None:
    equal = bool(torch.equal(a, b))
    results.append({"case": case, "equal": equal, "detail": "" if equal else f"{a.tolist()} != {b.tolist()}"[:400]})


def runs(rng: random.Random, bs: int, pool: int, width: int):
    """Per request: a pool row, a start and an end inside the row."""
    rows = torch.tensor(rng.sample(range(pool), bs), dtype=torch.int64)
    start = torch.tensor([rng.randrange(0, width // 2) for _ in range(bs)], dtype=torch.int64)
    end = start + torch.tensor([rng.randrange(0, width // 2) for _ in range(bs)], dtype=torch.int64)
    return rows, start, end


for seed in range(4):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, pool, width = rng.randint(1, 5), 8, 64
    rows, start, end = runs(rng, bs, pool, width)
    total = int((end - start).sum())
    locs = torch.randperm(1000)[:total].to(torch.int64)

    # assign_req_to_token_pool: out_cache_loc runs into req_to_token
    table_a = torch.full((pool, width), -7, dtype=torch.int32)
    table_b = table_a.clone()
    assign_req_to_token_pool[(bs,)](rows, table_a, start, end, locs, width, next_power_of_2(bs))
    ours.assign_req_to_token_pool_cpu(rows, table_b, start, end, locs, width)
    record(f"assign_req_to_token_pool seed {seed}", table_a, table_b)

    # assign_extend_cache_locs: req_to_token runs into out_cache_loc
    table = torch.randint(0, 5000, (pool, width), dtype=torch.int64)
    out_a = torch.full((total,), -1, dtype=torch.int64)
    out_b = out_a.clone()
    assign_extend_cache_locs[(bs,)](rows, table, start, end, out_a, width, next_power_of_2(bs))
    ours.assign_extend_cache_locs_cpu(rows, table, start, end, out_b, width)
    record(f"assign_extend_cache_locs seed {seed}", out_a, out_b)

    # assign_draft_cache_locs_contiguous
    topk, cols = rng.randint(1, 3), rng.randint(1, 6)
    seq_lens = torch.tensor([rng.randrange(0, width - topk * cols) for _ in range(bs)], dtype=torch.int64)
    out_a = torch.full((bs * topk * cols,), -1, dtype=torch.int64)
    out_b = out_a.clone()
    assign_draft_cache_locs_contiguous[(bs,)](rows, table, seq_lens, out_a, width, topk, cols, BS=bs)
    ours.assign_draft_cache_locs_contiguous_cpu(rows, table, seq_lens, out_b, width, topk, cols)
    record(f"assign_draft_cache_locs_contiguous seed {seed}", out_a, out_b)

    # fill_bonus_tokens / fill_accept_out_cache_loc
    stride = rng.randint(2, 7)
    accept_tokens = torch.randint(0, 256, (bs, stride), dtype=torch.int64)
    accept_lens = torch.randint(1, stride + 1, (bs,), dtype=torch.int32)
    bonus_a, bonus_b = torch.full((bs,), -1, dtype=torch.int64), torch.full((bs,), -1, dtype=torch.int64)
    fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, bonus_a, stride)
    ours.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_b, stride)
    record(f"fill_bonus_tokens seed {seed}", bonus_a, bonus_b)

    accept_index = torch.randint(0, bs * stride, (bs, stride), dtype=torch.int32)
    accept_index[torch.rand((bs, stride)) < 0.4] = -1
    out_cache = torch.randperm(4000)[: bs * stride].to(torch.int64)
    size = accept_index.numel()
    acc_a, acc_b = torch.full((size,), -1, dtype=torch.int64), torch.full((size,), -1, dtype=torch.int64)
    fill_accept_out_cache_loc[(size,)](accept_index, out_cache, acc_a, next_power_of_2(size))
    ours.fill_accept_out_cache_loc_cpu(accept_index, out_cache, acc_b)
    record(f"fill_accept_out_cache_loc seed {seed}", acc_a, acc_b)

    # copy_all_layer_kv_cache: overlapping moves inside every layer's buffers
    buffers_a = [torch.randn(40, 2, 16).to(torch.bfloat16) for _ in range(3)]
    buffers_b = [b.clone() for b in buffers_a]
    count = rng.randint(1, 12)
    src = torch.tensor(rng.sample(range(40), count), dtype=torch.int64)
    tgt = torch.tensor(rng.sample(range(40), count), dtype=torch.int64)
    stride_bytes = buffers_a[0][0].numel() * buffers_a[0].element_size()
    for buffers, run in ((buffers_a, "triton"), (buffers_b, "ours")):
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
        strides = torch.tensor([stride_bytes] * len(buffers), dtype=torch.int64)
        if run == "triton":
            tile = 128
            copy_all_layer_kv_cache_tiled[(len(buffers), -(-stride_bytes // tile))](
                ptrs, strides, tgt, src, count, next_power_of_2(count), tile)
        else:
            ours.copy_all_layer_kv_cache_cpu(ptrs.to(torch.int64), strides, tgt, src)
    record(f"copy_all_layer_kv_cache seed {seed}", torch.stack(buffers_a).view(torch.int16),
           torch.stack(buffers_b).view(torch.int16))


def random_tree(rng: random.Random, nodes: int):
    """parents of nodes 1..n-1 (each earlier), as SGLang's first-child / next-sibling links."""
    parents = [-1] + [rng.randrange(0, i) for i in range(1, nodes)]
    first_child, next_sibling = [-1] * nodes, [-1] * nodes
    for node in range(nodes - 1, 0, -1):  # children in index order
        next_sibling[node] = first_child[parents[node]]
        first_child[parents[node]] = node
    return parents, first_child, next_sibling


for seed in range(12):
    rng = random.Random(100 + seed)
    bs, nodes, spec_steps = rng.randint(1, 4), rng.randint(1, 12), rng.randint(2, 7)
    candidates, next_token, next_sibling, retrieve = [], [], [], []
    target = torch.randint(0, 4, (bs, nodes), dtype=torch.int64)
    for b in range(bs):
        parents, first, sibling = random_tree(rng, nodes)
        tokens = [rng.randrange(0, 4) for _ in range(nodes)]  # 4 symbols: matches are common
        candidates.append(tokens)
        next_token.append(first)
        next_sibling.append(sibling)
        retrieve.append([b * nodes + i for i in range(nodes)])
    args = [torch.tensor(x, dtype=torch.int64) for x in (candidates, retrieve, next_token, next_sibling)]
    outputs = []
    for run in ("triton", "ours"):
        predicts = torch.full((bs * nodes,), -1, dtype=torch.int32)
        accept_index = torch.full((bs, spec_steps), -1, dtype=torch.int32)
        accept_num = torch.full((bs,), -1, dtype=torch.int32)
        if run == "triton":
            verify_tree_greedy_triton(predicts, accept_index, accept_num, *args, target)
        else:
            ours.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                                        candidates=args[0], retrive_index=args[1], retrive_next_token=args[2],
                                        retrive_next_sibling=args[3], target_predict=target)
        outputs.append(torch.cat([predicts, accept_index.reshape(-1), accept_num]))
    record(f"verify_tree_greedy seed {seed} (bs {bs}, {nodes} nodes)", *outputs)

print(json.dumps(results))
