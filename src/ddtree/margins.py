"""How close a round came to going otherwise: the margins a decode loop records with
`DecodeConfig(record_margins=True)`, in logits (= log-prob) units, so that a run under other
arithmetic (a bf16 server against this float loop) can be told apart from a bug: where a
margin is small, both may be right and still differ.

Target side, per committed token: top-1 minus top-2 of the target's logits at the position
whose choice was committed (the root, then every accepted node).

Drafter side, per depth d = 1 .. min(accepted, D) of a round, whether the node of the target's
own path at depth d is drafted:
- DFlash's chain: at an accepted depth, the drafter's top-1 minus top-2 (a flip drafts
  another token and the round stops there); at the depth that stopped the round, the drafter's
  top-1 minus its logit for the target's choice (a flip would have drafted it);
- a DDTree tree (best-first by path log-probability, admission threshold = the lowest admitted
  score): an accepted node's score minus the threshold (how far it is from being displaced),
  then, at the depth that stopped the round, the threshold minus the score the target's choice
  would have had there (how far it was from being admitted).
"""
from __future__ import annotations

import torch

from ddtree.tree import DraftTree


def top2_margins(logits: torch.Tensor) -> list[float]:
    """logits [n, V] -> per row the top-1 minus top-2 value (0.0 for an exact tie)."""
    top = logits.float().topk(2, dim=-1).values  # [n, 2]
    return (top[:, 0] - top[:, 1]).tolist()


def chain_draft_margins(draft_logits: torch.Tensor, accepted: int, bonus: int) -> list[float]:
    """draft_logits [D, V] of a DFlash round that accepted `accepted` tokens (root included) and
    whose target choice after them is `bonus`."""
    depth_limit = draft_logits.shape[0]
    margins = top2_margins(draft_logits[: accepted - 1]) if accepted > 1 else []
    if accepted <= depth_limit:
        row = draft_logits[accepted - 1].float()
        margins.append(float(row.max() - row[bonus]))
    return margins


def tree_draft_margins(draft_logits: torch.Tensor, tree: DraftTree, keep_indices: list[int], bonus: int) -> list[float]:
    """draft_logits [D, V] of a DDTree round; `keep_indices` the accepted tree indices (root 0
    first), `bonus` the target's choice after the last of them."""
    scores = tree.node_scores_list  # pop order; tree index i is node i - 1
    if not scores:
        return []
    threshold = min(scores)
    path = keep_indices[1:]
    margins = [scores[index - 1] - threshold for index in path]
    depth = len(path) + 1  # the bonus token's depth
    if depth <= draft_logits.shape[0]:
        log_probs = torch.log_softmax(draft_logits[depth - 1].double(), dim=-1)
        parent = scores[path[-1] - 1] if path else 0.0
        margins.append(threshold - (parent + float(log_probs[bonus])))
    return margins
