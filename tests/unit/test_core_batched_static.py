"""The batched builder's device contract, checked without a GPU.

On the meta device tensors have shapes but no data, so any data-dependent step (`.item()`,
`nonzero`, boolean indexing: each a host sync on CUDA) or a host tensor mixed in fails there.
The same run, with every op's output storage tracked, gives the builder's allocations: a
model of its peak memory (the GPU test measures the real one), and its op count, which is its
number of kernel launches on a GPU.
"""
from __future__ import annotations

import collections
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddtree import GraphedTreeBuilder, build_ddtree_trees, build_verify_inputs
from ddtree import topk as topk_module
from ddtree.topk import shard_top_k


class AllocationModel(TorchDispatchMode):
    """Live bytes of the storages that ops create (inputs' storages excluded), the peak of
    that sum, the largest single allocation per op, and a count of ops."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.known = {id(t.untyped_storage()) for t in inputs}
        self.live = self.peak = 0
        self.largest = collections.Counter()  # op name -> its largest output storage
        self.ops = collections.Counter()

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self.known.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if id(storage) in self.known:  # a view of something already counted
                continue
            size = storage.nbytes()
            self.known.add(id(storage))
            self.live += size
            self.peak = max(self.peak, self.live)
            self.largest[str(func)] = max(self.largest[str(func)], size)
            weakref.finalize(storage, self._freed, id(storage), size)
        return out


@pytest.mark.parametrize(
    "bs, depth, vocab, budget",
    [(16, 15, 32000, 256), (3, 1, 50, 8), (2, 6, 5, 64), (4, 4, 1000, 1), (2, 5, 100, 0), (1, 3, 7, 4096)],
)
def test_batched_builder_and_verify_inputs_run_on_the_meta_device(bs, depth, vocab, budget):
    logits = torch.empty(bs, depth, vocab, dtype=torch.bfloat16, device="meta")
    batch = build_ddtree_trees(logits, budget)
    assert batch.token_ids.shape == batch.depths.shape == batch.scores.shape == (bs, budget)
    assert batch.parents.shape == (bs, budget + 1) and batch.visibility.shape == (bs, budget + 1, budget + 1)
    assert batch.num_nodes.shape == (bs,) and batch.token_ids.device.type == "meta"
    inputs = build_verify_inputs(batch, torch.empty(bs, dtype=torch.int64, device="meta"),
                                 torch.empty(bs, dtype=torch.int64, device="meta"), width=budget + 3)
    assert inputs.input_ids.shape == inputs.retrieve_next_token.shape == (bs, budget + 3)
    assert inputs.tree_mask.shape == (bs, budget + 3, budget + 3)


def test_allocation_model_of_batch_16_budget_1024_stays_under_64_mb():
    logits = torch.empty(16, 15, 151936, dtype=torch.bfloat16, device="meta")
    with AllocationModel(logits) as model:
        batch = build_ddtree_trees(logits, 1024)
    del batch
    # logsumexp's own temporary (one more float copy) and the kernels' scratch are not
    # dispatched ops; the model leaves them 16 MB of the 64
    assert model.peak < 48 * 2**20, f"modelled peak {model.peak / 2**20:.1f} MiB"
    one_depth = 16 * 151936 * 4
    assert model.largest["aten._to_copy.default"] <= max(topk_module.FLOAT_COPY_BYTES, one_depth)
    assert model.live == 0  # nothing the builder made outlives its result


def test_op_count_stays_small_because_each_op_is_a_kernel_launch():
    logits = torch.empty(16, 15, 32000, dtype=torch.bfloat16, device="meta")
    with AllocationModel(logits) as model:
        build_ddtree_trees(logits, 256)
    total = sum(model.ops.values())
    assert total <= 200, f"{total} ops: {model.ops.most_common(8)}"
    assert model.ops["aten.topk.default"] == 15  # one for all rows, one per deeper depth


@pytest.mark.parametrize("copy_bytes", [1, 3 * 4 * 70000 * 2, 2**30])  # 1 depth a copy, 2, all
@pytest.mark.parametrize("bs, depth", [(3, 7), (1, 7), (1, 2), (1, 1)])
def test_depth_chunked_logsumexp_is_bit_equal_to_each_requests_own_call(monkeypatch, copy_bytes, bs, depth):
    monkeypatch.setattr(topk_module, "FLOAT_COPY_BYTES", copy_bytes)
    gen = torch.Generator().manual_seed(4)
    # rows long enough for torch to split a lone row's sum over threads
    logits = (torch.randn(bs, depth, 70000, generator=gen) * 3).to(torch.bfloat16)
    shard = shard_top_k(logits, 12)
    for b in range(bs):
        x = logits[b].float()  # [D, V]: the heap oracle's own logsumexp call
        assert torch.equal(shard.lse[b], torch.logsumexp(x, dim=-1)), (b, shard.lse[b] - torch.logsumexp(x, dim=-1))
        values, ids = torch.topk(x, 12, dim=-1)
        assert torch.equal(shard.values[b], values) and torch.equal(shard.token_ids[b], ids)


def test_depth_chunks_cover_every_depth_once_and_never_leave_a_lone_row(monkeypatch):
    for copy_bytes in (1, 4000 * 4, 3 * 4000 * 4, 2**30):
        monkeypatch.setattr(topk_module, "FLOAT_COPY_BYTES", copy_bytes)
        for bs, depth in ((1, 1), (1, 2), (1, 7), (2, 7), (5, 15)):
            chunks = topk_module.depth_chunks(bs, depth, 4000)
            assert [d for a, b in chunks for d in range(a, b)] == list(range(depth))
            if bs == 1 and depth > 1:
                assert min(b - a for a, b in chunks) >= 2, chunks


def test_graphed_builder_off_cuda_runs_the_builder_eagerly():
    gen = torch.Generator().manual_seed(5)
    builder = GraphedTreeBuilder(3, 4, 300, 32, dtype=torch.float32, device="cpu")
    assert not builder.captured
    for _ in range(2):
        logits = torch.randn(3, 4, 300, generator=gen)
        got, expected = builder(logits), build_ddtree_trees(logits, 32)
        for field in ("token_ids", "depths", "parents", "num_nodes", "scores", "visibility"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), field


def test_graphed_builder_refuses_other_shapes_and_bad_sizes():
    builder = GraphedTreeBuilder(2, 3, 50, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"\(2, 3, 51\) torch.float32 on cpu do not match the captured \(2, 3, 50\)"):
        builder(torch.zeros(2, 3, 51))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        builder(torch.zeros(2, 3, 50, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="vocab must be an int >= 1, got 0"):
        GraphedTreeBuilder(2, 3, 0, 8, device="cpu")
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        GraphedTreeBuilder(2, 3, 50, -1, device="cpu")
    with pytest.raises(ValueError, match="dtype must be a float dtype"):
        GraphedTreeBuilder(2, 3, 50, 8, dtype=torch.int64, device="cpu")
