"""Stage `invariants`: random drafter logits on the host's best device; every tree passes
`validate_tree`; the fast and batched builders return the reference heap's trees exactly;
the walk over the packed verify arrays (SGLang's retrieve layout) accepts exactly what
`follow_verified_tree` accepts, the root-rejected case included."""
from __future__ import annotations

from typing import Any, NamedTuple

from ddtree_ops.hostside.protocol import StageContext, StageResult

NAME = "invariants"
DESCRIPTION = "validate_tree, fast/batched == heap, retrieve-array walk == follow_verified_tree"

BATCH = 4


class Case(NamedTuple):
    depth: int
    vocab: int
    budget: int
    peaked: bool


CASES = (
    Case(15, 2000, 64, False),
    Case(15, 2000, 256, True),
    Case(15, 32000, 1024, True),
    Case(1, 50, 16, False),
    Case(4, 3, 100, False),  # V < budget: the whole reachable tree
    Case(3, 10, 1, True),
    Case(6, 40, 0, False),  # the root alone
)


def make_logits(torch: Any, case: Case, seed: int, device: str) -> Any:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(BATCH, case.depth, case.vocab, generator=generator)  # [bs, D, V] f32
    if case.peaked:
        logits *= 0.5
        top = torch.randint(0, case.vocab, (BATCH, case.depth), generator=generator)
        logits.scatter_add_(2, top.unsqueeze(2), torch.full((BATCH, case.depth, 1), 8.0))
    return logits.to(device)


def same_tree(a: Any, b: Any) -> str:
    """'' when both trees have the same parents, tokens and depths; else what differs."""
    if list(a.parents) != list(b.parents):
        return f"parents differ at {next(i for i, (x, y) in enumerate(zip(a.parents, b.parents)) if x != y) if len(a.parents) == len(b.parents) else 'length'}"
    if a.node_token_ids.tolist() != b.node_token_ids.tolist():
        return "node_token_ids differ"
    if a.node_depths.tolist() != b.node_depths.tolist():
        return "node_depths differ"
    return ""


def posteriors_for(torch: Any, trees: list, width: int, generator: Any) -> list[list[int]]:
    """One posterior per tree, [width] tokens: request 0 rejects even the root's children;
    the others follow a random path and stop with an off-tree token."""
    out = []
    for b, tree in enumerate(trees):
        posterior = [int(t) for t in torch.randint(10**6, 2 * 10**6, (width,), generator=generator)]
        if b > 0 and tree.num_nodes:
            node = int(torch.randint(1, tree.num_nodes + 1, (1,), generator=generator))
            path = []
            while node > 0:
                path.append(node)
                node = tree.parents[node]
            path.reverse()  # root's child first
            current = 0
            for child in path:
                posterior[current] = int(tree.node_token_ids[child - 1])
                current = child
        out.append(posterior)
    return out


def run(ctx: StageContext) -> StageResult:
    import torch

    from ddtree import BuildMethod, build_ddtree_tree_from_logits, build_ddtree_trees, \
        follow_verified_tree, validate_tree
    from ddtree.verify import build_verify_inputs, walk_retrieve_arrays

    device = ctx.device
    generator = torch.Generator(device="cpu").manual_seed(ctx.options.seed + 1)
    problems: list[str] = []
    checked = {"trees": 0, "walks": 0, "root_rejected": 0}
    for number, case in enumerate(CASES):
        label = f"case {number} (D={case.depth}, V={case.vocab}, budget={case.budget})"
        logits = make_logits(torch, case, ctx.options.seed * 1000 + number, device)
        batch = build_ddtree_trees(logits, case.budget)
        heap_trees = []
        for b in range(BATCH):
            heap = build_ddtree_tree_from_logits(logits[b], case.budget, method=BuildMethod.HEAP)
            heap_trees.append(heap)
            for kind, tree in (("heap", heap),
                               ("fast", build_ddtree_tree_from_logits(logits[b], case.budget,
                                                                      method=BuildMethod.FAST)),
                               ("batched", batch.tree(b))):
                try:
                    validate_tree(tree, case.budget, logits[b])
                except (AssertionError, ValueError) as err:
                    problems.append(f"{label} request {b}: {kind} tree invalid: {err}")
                diff = same_tree(heap, tree) if kind != "heap" else ""
                if diff:
                    problems.append(f"{label} request {b}: {kind} != heap: {diff}")
                checked["trees"] += 1
        width = case.budget + 1
        inputs = build_verify_inputs(
            batch, torch.randint(0, case.vocab, (BATCH,), generator=generator).to(device),
            torch.full((BATCH,), 100, dtype=torch.int64, device=device))
        posteriors = posteriors_for(torch, heap_trees, width, generator)
        target = torch.tensor(posteriors, dtype=torch.int64, device=device)  # [bs, N] int64
        accept_index, accept_length, bonus = walk_retrieve_arrays(
            inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token,
            inputs.retrieve_next_sibling, target)
        for b, tree in enumerate(heap_trees):
            accepted, expected_bonus = follow_verified_tree(tree.child_maps,
                                                            posteriors[b][: tree.num_nodes + 1])
            walked = [int(i) - b * width for i in accept_index[b].tolist() if i >= 0]
            if walked != accepted or int(accept_length[b]) != len(accepted) - 1 \
                    or int(bonus[b]) != expected_bonus:
                problems.append(f"{label} request {b}: retrieve walk {walked} bonus "
                                f"{int(bonus[b])} != follow_verified_tree {accepted} bonus "
                                f"{expected_bonus}")
            checked["walks"] += 1
            checked["root_rejected"] += accepted == [0]
    if checked["root_rejected"] == 0:
        problems.append("no walk exercised the root-rejected case")
    metrics = {"device": device, "cases": len(CASES), "batch": BATCH, **checked,
               "problems": problems[:20]}
    if problems:
        return StageResult.failed(problems[0] + (f" (+{len(problems) - 1} more)"
                                                 if len(problems) > 1 else ""), metrics=metrics)
    return StageResult.passed(f"{checked['trees']} trees valid and equal to the heap's, "
                              f"{checked['walks']} walks match ({checked['root_rejected']} "
                              f"root-rejected) on {device}", metrics=metrics)
