"""`GraphedTreeBuilder`: `build_ddtree_trees` captured once into a CUDA graph for one static
(bs, D, V, dtype, budget), then replayed on every call.

Eager, the batched builder is ~170 small ops, and on a GPU each costs a few microseconds of
host time to launch: the launches, not the kernels, would set its speed at decode batch sizes.
A replay launches them all at once. The builder has static shapes and no host sync, which is
what capture needs. Off CUDA the same object runs the builder eagerly, so code written
against it runs on any device.
"""
from __future__ import annotations

import torch

from ddtree.batched import TreeBatch, build_ddtree_trees
from ddtree.inputs import check_budget

# Eager calls before capture: lazy initialisation (kernel loading, library workspaces) must
# not happen inside the capture.
WARMUP_CALLS = 2


class GraphedTreeBuilder:
    """Calls return the same `TreeBatch` object, overwritten by the next call: clone what must
    outlive it. The input is copied into a static buffer (device to device, no host sync)."""

    def __init__(self, batch_size: int, depth: int, vocab: int, budget: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda"):
        for name, value in (("batch_size", batch_size), ("depth", depth), ("vocab", vocab)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        self.budget = check_budget(budget)
        self.logits = torch.zeros(batch_size, depth, vocab, dtype=dtype, device=device)  # the static input
        self._graph: torch.cuda.CUDAGraph | None = None
        self._output: TreeBatch | None = None
        if self.logits.device.type == "cuda":
            self._capture()

    @property
    def captured(self) -> bool:
        """True when calls replay a CUDA graph; False when they run the builder eagerly."""
        return self._graph is not None

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.logits.device)
        side.wait_stream(torch.cuda.current_stream(self.logits.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                build_ddtree_trees(self.logits, self.budget)
        torch.cuda.current_stream(self.logits.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._output = build_ddtree_trees(self.logits, self.budget)
        self._graph = graph

    def __call__(self, logits: torch.Tensor) -> TreeBatch:
        expected = (tuple(self.logits.shape), self.logits.dtype, self.logits.device)
        if (tuple(logits.shape), logits.dtype, logits.device) != expected:
            raise ValueError(
                f"logits {tuple(logits.shape)} {logits.dtype} on {logits.device} do not match the captured "
                f"{expected[0]} {expected[1]} on {expected[2]}"
            )
        if self._graph is None:
            return build_ddtree_trees(logits, self.budget)
        self.logits.copy_(logits)
        self._graph.replay()
        return self._output
