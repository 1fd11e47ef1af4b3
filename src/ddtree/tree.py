"""`DraftTree`: one DDTree draft tree, the shape every other part of the core reads.

Index 0 is the root (the bonus token, not counted in the budget); nodes 1..N follow in pop
order, so a parent always has a smaller index than its children.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class DraftTree:
    """The pop-order arrays; `child_maps` and `visibility` are derived on first use (a decode
    loop that packs verify inputs from the arrays never pays for them)."""

    parents: list[int]  # len N+1; parents[0] == -1, parents[i] < i
    node_token_ids: torch.Tensor  # [N] int64, pop order
    node_depths: torch.Tensor  # [N] int64, values 1..D
    node_scores: torch.Tensor  # [N] float64 logw (sum of log-probabilities on the path)

    @property
    def num_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.parents) - 1

    @property
    def max_depth(self) -> int:
        return int(self.node_depths.max()) if self.num_nodes else 0

    @cached_property
    def child_maps(self) -> list[dict[int, int]]:
        """len N+1; child_maps[i][token_id] = child index."""
        child_maps: list[dict[int, int]] = [{} for _ in self.parents]
        for index, (parent, token) in enumerate(zip(self.parents[1:], self.node_token_ids.tolist()), start=1):
            child_maps[parent][token] = index
        return child_maps

    @cached_property
    def visibility(self) -> torch.Tensor:
        """[N+1, N+1] bool; [i, j] iff j is i or an ancestor of i."""
        if len(self.parents) <= BITSET_MAX_NODES:
            return bitset_visibility(self.parents)
        return ancestor_visibility(torch.tensor(self.parents, dtype=torch.int64), self.max_depth)


# Up to this many nodes (root included) a Python walk with integer bitsets builds the mask in
# ~1/3 of the time of `max_depth` tensor steps (a decode loop's small trees); beyond it the
# tensor steps win (measured on a 2-core CPU).
BITSET_MAX_NODES = 128
_BIT_VALUES = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def bitset_visibility(parents: list[int]) -> torch.Tensor:
    """`ancestor_visibility` for one host tree: node i's row is its parent's row plus bit i."""
    count = len(parents)
    rows = [1]
    for index in range(1, count):
        rows.append(rows[parents[index]] | (1 << index))
    width = (count + 7) // 8
    packed = torch.frombuffer(bytearray(b"".join(row.to_bytes(width, "little") for row in rows)), dtype=torch.uint8)
    bits = (packed.view(count, width, 1) & _BIT_VALUES).ne(0)  # [N+1, width, 8], bit b of byte w
    return bits.view(count, width * 8)[:, :count].contiguous()


def root_only_tree() -> DraftTree:
    """The tree of a zero budget or an empty draft: the root alone."""
    return make_draft_tree(
        [-1],
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.float64),
    )


def make_draft_tree(
    parents: list[int],
    node_token_ids: torch.Tensor,  # [N] int64
    node_depths: torch.Tensor,  # [N] int64
    node_scores: torch.Tensor,  # [N] float64
) -> DraftTree:
    """A tree from its pop-order arrays (host tensors)."""
    return DraftTree(parents, node_token_ids, node_depths, node_scores)


def ancestor_visibility(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self mask from a parent array.

    parents: [..., N+1] int64, root (and detached padding) = -1, parents[i] < i.
    Returns [..., N+1, N+1] bool. One gather per tree level: `max_depth` steps, no per-node loop.
    """
    size = parents.shape[-1]
    rows = torch.arange(size, device=parents.device)
    ancestor = rows.expand_as(parents).clone()  # [..., N+1] current ancestor of each node
    # A node with no parent points at itself, so walking past the root (or a detached
    # padding node) stays put and only re-marks the diagonal.
    step = torch.where(parents < 0, rows.expand_as(parents), parents)
    visibility = torch.zeros(*parents.shape, size, dtype=torch.bool, device=parents.device)
    visibility.scatter_(-1, ancestor.unsqueeze(-1), True)
    for _ in range(max_depth):
        ancestor = torch.gather(step, -1, ancestor)
        visibility.scatter_(-1, ancestor.unsqueeze(-1), True)
    return visibility
