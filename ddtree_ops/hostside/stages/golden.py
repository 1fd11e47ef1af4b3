"""Stage `golden`: the seed's golden vector, and the seed's own smoke script, exactly.

The seed document (shared/seeds/000_44c6339df762f231.txt) shows a python heredoc and the four
lines it printed on an eval host; hosts have no copy of that document, so both the script and
its expected output are carried here verbatim, with only the `sys.path` line pointed at the
release. The root-rejected walk, which the seed left out, is checked too.
"""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from ddtree_ops.hostside.protocol import StageContext, StageResult

NAME = "golden"
DESCRIPTION = "the seed's golden vector and its own smoke script output, exactly"

# The seed's script, unchanged but for the sys.path line ({path} = the release's src).
SEED_SCRIPT = """\
import sys, torch
sys.path.insert(0, {path!r})
from sglang_ddtree_utils import build_ddtree_tree_from_logits, follow_verified_tree, summarize_ddtree, assert_prefix_closed
logits = torch.tensor([[5.0,4.0,1.0],[4.0,3.0,2.0],[3.0,2.0,1.0]])
tree = build_ddtree_tree_from_logits(logits, budget=5)
assert_prefix_closed(tree)
accepted, bonus = follow_verified_tree(tree.child_maps, [int(tree.node_token_ids[0]), 123, 456, 789, 111, 222])
print(tree.parents)
print(tree.node_token_ids.tolist())
print(tree.node_depths.tolist())
print(summarize_ddtree(tree, 5, accepted, bonus).to_dict())
"""

# What the seed's run printed, verbatim.
SEED_OUTPUT = [
    "[-1, 0, 1, 2, 0, 1]",
    "[0, 0, 0, 1, 1]",
    "[1, 2, 3, 1, 2]",
    "{'budget': 5, 'actual_nodes': 5, 'max_depth': 3, 'mean_depth': 1.8, 'leaf_count': 3, "
    "'branch_count': 2, 'accepted_node_count': 2, 'accepted_draft_count': 1, "
    "'accepted_path_depth': 1, 'bonus_token_id': 123}",
]

SEED_MODULE = "sglang_ddtree_utils"


def _seed_module_dir(src_root: Path) -> Path | None:
    """Where the release keeps the seed-named module (`sglang_ddtree_utils`), if it does."""
    for candidate in sorted(src_root.rglob(f"{SEED_MODULE}.py")) + \
            sorted(src_root.rglob(f"{SEED_MODULE}/__init__.py")):
        return candidate.parent if candidate.name != "__init__.py" else candidate.parent.parent
    return None


def run_seed_script(src_root: Path) -> tuple[list[str], str]:
    """Execute the seed script in this process (no new interpreter, no second torch import);
    return its stdout lines and where `sglang_ddtree_utils` came from."""
    module_dir = _seed_module_dir(src_root)
    saved_path, saved_module = list(sys.path), sys.modules.get(SEED_MODULE)
    if module_dir is None:
        import ddtree  # the release has no seed-named module: the seed's names live in ddtree

        sys.modules[SEED_MODULE] = ddtree
        origin = "ddtree (the seed's names, re-exported)"
    else:
        origin = str(module_dir / SEED_MODULE)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = compile(SEED_SCRIPT.format(path=str(module_dir or src_root)),
                           "<seed smoke script>", "exec")
            exec(code, {"__name__": "__main__"})  # noqa: S102 - our own constant text
    finally:
        sys.path[:] = saved_path
        if saved_module is None:
            sys.modules.pop(SEED_MODULE, None)
        else:
            sys.modules[SEED_MODULE] = saved_module
    return out.getvalue().splitlines(), origin


def check_golden_vector() -> list[str]:
    """The spec's golden vector through the public API, plus the root-rejected walk."""
    import torch
    from ddtree import build_ddtree_tree_from_logits, follow_verified_tree, summarize_ddtree

    problems = []
    logits = torch.tensor([[5.0, 4.0, 1.0], [4.0, 3.0, 2.0], [3.0, 2.0, 1.0]])  # [D=3, V=3] f32
    tree = build_ddtree_tree_from_logits(logits, budget=5)
    expect = {"parents": [-1, 0, 1, 2, 0, 1], "node_token_ids": [0, 0, 0, 1, 1],
              "node_depths": [1, 2, 3, 1, 2]}
    got = {"parents": list(tree.parents), "node_token_ids": tree.node_token_ids.tolist(),
           "node_depths": tree.node_depths.tolist()}
    problems += [f"{k}: got {got[k]}, expected {v}" for k, v in expect.items() if got[k] != v]
    accepted, bonus = follow_verified_tree(tree.child_maps, [0, 123, 456, 789, 111, 222])
    if (list(accepted), int(bonus)) != ([0, 1], 123):
        problems.append(f"walk: got accepted {list(accepted)}, bonus {bonus}; expected [0, 1], 123")
    summary = summarize_ddtree(tree, 5, accepted, bonus).to_dict()
    expected_summary = {"budget": 5, "actual_nodes": 5, "max_depth": 3, "mean_depth": 1.8,
                        "leaf_count": 3, "branch_count": 2, "accepted_node_count": 2,
                        "accepted_draft_count": 1, "accepted_path_depth": 1,
                        "bonus_token_id": 123}
    if summary != expected_summary:
        problems.append(f"summary: got {summary}")
    # Root rejected: the target's first choice is no child of the root.
    accepted, bonus = follow_verified_tree(tree.child_maps, [2, 7, 7, 7, 7, 7])
    if (list(accepted), int(bonus)) != ([0], 2):
        problems.append(f"root-rejected walk: got accepted {list(accepted)}, bonus {bonus}; "
                        f"expected [0], 2")
    return problems


def run(ctx: StageContext) -> StageResult:
    src_root = Path(ctx.release_root) / "src"
    problems = check_golden_vector()
    lines, origin = run_seed_script(src_root)
    ctx.log(f"seed script ran against {origin}")
    for line in lines:
        ctx.log(f"seed> {line}")
    if lines != SEED_OUTPUT:
        for index, (want, got) in enumerate(zip(SEED_OUTPUT + [""] * 9, lines + [""] * 9)):
            if want != got:
                problems.append(f"seed script line {index + 1}: got {got!r}, expected {want!r}")
                break
    metrics = {"seed_output_matches": lines == SEED_OUTPUT, "seed_module": origin,
               "seed_output": lines}
    if problems:
        return StageResult.failed(problems[0] + (f" (+{len(problems) - 1} more)"
                                                 if len(problems) > 1 else ""), metrics=metrics)
    return StageResult.passed("golden vector, root-rejected walk and the seed's 4 lines match",
                              metrics=metrics)
