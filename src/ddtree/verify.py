"""Verifying a round: the tree walk, and the verify inputs of a batch of trees.

Verify width N = budget + 1 (root + nodes). Request b's tree index i (0 = root) is column i
of every [bs, N] array; trees smaller than N are padded with detached nodes: token 0,
position = start, a mask row that sees only itself, never linked as a child or sibling.
The retrieve arrays follow SGLang's tree verify kernels (`eagle_utils.verify_tree_greedy`):
retrieve_index[b, i] = b*N + i, retrieve_next_token = first child (local index) or -1,
retrieve_next_sibling = next sibling or -1.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch

from ddtree.batched import TreeBatch
from ddtree.tree import DraftTree


def follow_verified_tree(
    child_maps: list[dict[int, int]],
    posterior: Sequence[int] | torch.Tensor,  # [N+1] or [1, N+1] int: the target's token per tree index
) -> tuple[list[int], int]:
    """Walk from the root while the target's token at the current index is a child's token.

    Returns (accepted tree indices, starting with 0; the bonus token = posterior[last index]).
    """
    if isinstance(posterior, torch.Tensor):
        if posterior.dim() == 2 and posterior.shape[0] == 1:
            posterior = posterior[0]  # the reference's [1, N+1] layout
        if posterior.dim() != 1:
            raise ValueError(f"posterior must have shape [N+1] or [1, N+1], got {tuple(posterior.shape)}")
        posterior = posterior.tolist()
    tokens = [int(t) for t in posterior]
    if len(tokens) < len(child_maps):
        raise ValueError(f"posterior has {len(tokens)} tokens for a tree of {len(child_maps)} indices")
    accepted = [0]
    current = 0
    token = tokens[0]
    while token in child_maps[current]:
        current = child_maps[current][token]
        accepted.append(current)
        token = tokens[current]
    return accepted, token


class MaskLayout(IntEnum):
    """SGLang's tree mask modes (`TreeMaskMode`): FULL_MASK = 0, QLEN_ONLY = 1."""

    FULL = 0  # per request: N rows of (prefix columns, all true) + (N tree columns)
    QLEN = 1  # per request: the N x N tree block only


@dataclass
class VerifyInputs:
    input_ids: torch.Tensor  # [bs, N] int64: root (bonus), node tokens, padding 0
    positions: torch.Tensor  # [bs, N] int64: start + depth (padding: start)
    tree_mask: torch.Tensor  # [bs, N, N] bool ancestor-or-self; padding rows self only
    retrieve_index: torch.Tensor  # [bs, N] int64 = b*N + i
    retrieve_next_token: torch.Tensor  # [bs, N] int64 first child or -1
    retrieve_next_sibling: torch.Tensor  # [bs, N] int64 next sibling or -1
    tree_sizes: torch.Tensor  # [bs] int64 real tree tokens (1 + nodes)

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def draft_tokens(self) -> torch.Tensor:
        """[bs * N] int64, SGLang's flat `draft_token`."""
        return self.input_ids.reshape(-1)

    def attention_mask(self, context_lens: torch.Tensor, context_width: int) -> torch.Tensor:
        """[bs, N, C + N] bool over (context columns, tree columns); context column j is
        visible iff j < context_lens[b] (context_lens: [bs] int64, C = context_width)."""
        bs, width = self.input_ids.shape
        _check_per_request("context_lens", context_lens, bs)
        columns = torch.arange(context_width, device=self.input_ids.device)
        context = (columns < context_lens.to(self.input_ids.device).unsqueeze(1)).unsqueeze(1)  # [bs, 1, C]
        return torch.cat([context.expand(bs, width, context_width), self.tree_mask], dim=2)

    def additive_attention_mask(
        self, context_lens: torch.Tensor, context_width: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """[bs, 1, N, C + N] float: 0 where visible, finfo(dtype).min elsewhere (HF 4-D mask)."""
        visible = self.attention_mask(context_lens, context_width)
        mask = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
        return mask.masked_fill_(visible, 0.0).unsqueeze(1)

    def custom_mask(self, prefix_lens: torch.Tensor, layout: MaskLayout, total_prefix: int | None = None) -> torch.Tensor:
        """SGLang's flat bool `custom_mask`, requests concatenated.

        prefix_lens: [bs] int64 committed tokens per request (the sequence lengths).
        FULL is sized from sum(prefix_lens) on the host: pass `total_prefix`, that sum or any
        host upper bound of it, to avoid a device sync.
        """
        return pack_custom_mask(self.tree_mask, prefix_lens, layout, total_prefix)


def pack_custom_mask(
    tree_mask: torch.Tensor,  # [bs, N, N] bool
    prefix_lens: torch.Tensor,  # [bs] int64
    layout: MaskLayout,
    total_prefix: int | None = None,
) -> torch.Tensor:
    """Flat bool mask: QLEN [bs*N*N]; FULL [N*(total_prefix + bs*N)], each row = prefix (true)
    then the tree row, request b starting at sum_{c<b} N*(prefix_c + N). `total_prefix` is
    sum(prefix_lens) (read from the device when None) or a host upper bound of it: the cells
    past the last request are then True padding, as SGLang pads a short mask. Built with index
    arithmetic on the mask's device."""
    layout = MaskLayout(layout)
    bs, width, _ = tree_mask.shape
    _check_per_request("prefix_lens", prefix_lens, bs)
    if layout is MaskLayout.QLEN:
        return tree_mask.reshape(-1).clone()
    prefix_lens = prefix_lens.to(device=tree_mask.device, dtype=torch.int64)
    if total_prefix is None:
        total_prefix = int(prefix_lens.sum())
    row_len = prefix_lens + width  # [bs]
    request_start = torch.cumsum(width * row_len, 0) - width * row_len  # [bs]
    rows = torch.arange(width, device=tree_mask.device)
    # start of tree column 0 in row r of request b
    tree_start = request_start[:, None] + rows[None, :] * row_len[:, None] + prefix_lens[:, None]  # [bs, N]
    index = tree_start[:, :, None] + rows[None, None, :]  # [bs, N, N]
    out = torch.ones(width * (total_prefix + bs * width), dtype=torch.bool, device=tree_mask.device)
    out[index.reshape(-1)] = tree_mask.reshape(-1)
    return out


def _first_child_and_next_sibling(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents: [bs, N] int64 (-1 = root or detached). Returns ([bs, N] first child, [bs, N]
    next sibling), local indices, -1 for none; children ordered by index (pop order)."""
    bs, width = parents.shape
    index = torch.arange(width, device=parents.device).expand(bs, width)
    group = torch.where(parents >= 0, parents, width)  # detached nodes form no sibling group
    order = torch.argsort(group * width + index, dim=1)  # grouped by parent, ascending index
    sorted_group = torch.gather(group, 1, order)
    same_next = (sorted_group[:, 1:] == sorted_group[:, :-1]) & (sorted_group[:, :-1] < width)
    next_in_order = torch.where(same_next, order[:, 1:], -1)
    next_sibling = torch.full_like(parents, -1)
    next_sibling.scatter_(1, order[:, :-1], next_in_order)
    starts = torch.ones_like(sorted_group, dtype=torch.bool)
    starts[:, 1:] = sorted_group[:, 1:] != sorted_group[:, :-1]
    first_child = torch.full((bs, width + 1), -1, dtype=torch.int64, device=parents.device)
    # Non-start entries write into the spare column `width`, dropped below.
    target = torch.where(starts, sorted_group, width)
    first_child.scatter_(1, target, torch.where(starts, order, -1))
    return first_child[:, :width].contiguous(), next_sibling  # SGLang's kernels take contiguous rows only


def _check_per_request(name: str, value: torch.Tensor, bs: int) -> None:
    """One entry per request: a shape check only (the values stay on the device, no sync)."""
    if tuple(value.shape) != (bs,):
        raise ValueError(f"{name} must have shape [{bs}] (one per request), got {tuple(value.shape)}")


def build_verify_inputs(
    trees: TreeBatch | Sequence[DraftTree],
    root_token_ids: torch.Tensor,  # [bs] int64, each request's bonus token
    start_positions: torch.Tensor,  # [bs] int64, the root's position
    width: int | None = None,
) -> VerifyInputs:
    """Verify inputs for a batch; width N defaults to budget + 1. Vectorised, no host sync."""
    if not isinstance(trees, TreeBatch):
        largest = max((t.num_nodes for t in trees), default=0)
        if width is not None and largest + 1 > width:
            raise ValueError(f"verify width {width} is smaller than the largest tree's {largest} nodes + 1 = {largest + 1}")
        trees = TreeBatch.from_trees(trees, None if width is None else width - 1, device=root_token_ids.device)
    bs, budget = trees.token_ids.shape
    width = budget + 1 if width is None else width
    if width < budget + 1:
        raise ValueError(f"verify width {width} is smaller than budget + 1 = {budget + 1}")
    for name, value in (("root_token_ids", root_token_ids), ("start_positions", start_positions)):
        _check_per_request(name, value, bs)
    device = trees.token_ids.device
    pad = width - 1 - budget
    input_ids = torch.zeros(bs, width, dtype=torch.int64, device=device)
    input_ids[:, 0] = root_token_ids.to(device)
    input_ids[:, 1 : budget + 1] = trees.token_ids
    depths = torch.zeros(bs, width, dtype=torch.int64, device=device)
    depths[:, 1 : budget + 1] = trees.depths
    positions = start_positions.to(device=device, dtype=torch.int64).unsqueeze(1) + depths
    parents = torch.nn.functional.pad(trees.parents, (0, pad), value=-1)  # [bs, N]
    tree_mask = torch.nn.functional.pad(trees.visibility, (0, pad, 0, pad), value=False)
    if pad:
        padding = torch.arange(budget + 1, width, device=device)
        tree_mask[:, padding, padding] = True
    first_child, next_sibling = _first_child_and_next_sibling(parents)
    retrieve_index = torch.arange(bs * width, device=device).reshape(bs, width)
    return VerifyInputs(
        input_ids=input_ids,
        positions=positions,
        tree_mask=tree_mask,
        retrieve_index=retrieve_index,
        retrieve_next_token=first_child,
        retrieve_next_sibling=next_sibling,
        tree_sizes=trees.num_nodes + 1,
    )


def walk_retrieve_arrays(
    candidates: torch.Tensor,  # [bs, N] int64 draft tokens (VerifyInputs.input_ids)
    retrieve_index: torch.Tensor,  # [bs, N] int64
    retrieve_next_token: torch.Tensor,  # [bs, N] int64
    retrieve_next_sibling: torch.Tensor,  # [bs, N] int64
    target_predict: torch.Tensor,  # [bs, N] int64 the target's token per tree index
    num_steps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy tree walk over the retrieve arrays, as SGLang's `verify_tree_greedy` does it,
    in plain torch (batch-vectorised, a host loop over steps: a reference, not a fast path).

    Returns (accept_index [bs, num_steps] int64 flat indices, -1 padded; accept_length [bs]
    int64 accepted drafts, root excluded; bonus [bs] int64 = target token at the last accepted).
    """
    bs, width = candidates.shape
    num_steps = width if num_steps is None else num_steps
    device = candidates.device
    batch = torch.arange(bs, device=device)
    flat_predict = target_predict.reshape(-1)
    accept_index = torch.full((bs, num_steps), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = retrieve_index[:, 0]
    last = retrieve_index[:, 0].clone()  # flat index of the last accepted token
    accepted = torch.zeros(bs, dtype=torch.int64, device=device)
    active = torch.ones(bs, dtype=torch.bool, device=device)
    current = torch.zeros(bs, dtype=torch.int64, device=device)
    for _ in range(1, num_steps):
        current = torch.where(active, retrieve_next_token[batch, current.clamp(min=0)], -1)
        searching = active & (current >= 0)
        matched = torch.zeros_like(active)
        while bool(searching.any()):
            at = current.clamp(min=0)
            hit = searching & (candidates[batch, at] == flat_predict[last])
            accepted += hit.long()
            accept_index[batch[hit], accepted[hit]] = retrieve_index[batch[hit], at[hit]]
            last = torch.where(hit, retrieve_index[batch, at], last)
            matched |= hit
            current = torch.where(searching & ~hit, retrieve_next_sibling[batch, at], current)
            searching = searching & ~hit & (current >= 0)
        active = matched
        if not bool(active.any()):
            break
    return accept_index, accepted, flat_predict[last]
