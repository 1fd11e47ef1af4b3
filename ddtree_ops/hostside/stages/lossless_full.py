"""Stage `lossless-full`: the `lossless` stage's thorough profile (two models, budgets
1/4/16/64, 800 sampled runs; tens of seconds on a CPU). Not in the default order: run it with
`ddtree-ops smoke --stages lossless-full`."""
from __future__ import annotations

from ddtree_ops.hostside.protocol import StageContext, StageResult
from ddtree_ops.hostside.stages import lossless

NAME = "lossless-full"
DESCRIPTION = "the lossless proof with more models, budgets, tokens and samples"


def run(ctx: StageContext) -> StageResult:
    return lossless.run_profile(ctx, lossless.select_profile({**ctx.options.extra, "lossless_full": True}))
