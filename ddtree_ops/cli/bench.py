"""`ddtree-ops bench`: the benchmark sweeps as one command (tree-bench; decode-bench and the
SGLang sweep once the release has them), on every selected host, ending in the report."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ddtree_ops.cli.options import (
    DEFAULT_PARALLEL,
    AcceptNewHostKeysOpt,
    HostsOpt,
    InventoryOpt,
    JsonOpt,
    ParallelOpt,
)
from ddtree_ops.cli.report import RunsDirOpt
from ddtree_ops.cli.smoke import (
    BatchSizesOpt,
    BudgetsOpt,
    NoPushOpt,
    SeedOpt,
    SourceOpt,
    SetOpt,
    StageTimeoutOpt,
    VerboseOpt,
    build_options,
    run_smoke,
)
from ddtree_ops.smoke import DEFAULT_STAGE_TIMEOUT_S

# The sweep stages, in order; those a release lacks are left out.
BENCH_STAGES = ("env", "tree-bench", "decode-bench", "sglang-e2e")
DEFAULT_BENCH_REPEAT = 10


def _bench_stages(source: Optional[Path], push: bool) -> list[str]:
    if not push:
        return ["env", "tree-bench"]
    from ddtree_ops.release import STAGES_DIR, build_bundle

    relpaths = {f.relpath for f in build_bundle(source).files}
    return [s for s in BENCH_STAGES if f"{STAGES_DIR}/{s.replace('-', '_')}.py" in relpaths]


def bench(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    budgets: BudgetsOpt = None,
    batch_sizes: BatchSizesOpt = None,
    repeat: Annotated[int, typer.Option("--repeat", min=1,
                                        help="Timed calls per point (median).")] = DEFAULT_BENCH_REPEAT,
    seed: SeedOpt = 0,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Also write the PNG charts into DIR.", show_default=False)] = None,
    json_out: JsonOpt = False,
    no_push: NoPushOpt = False,
    source: SourceOpt = None,
    stage_timeout: StageTimeoutOpt = DEFAULT_STAGE_TIMEOUT_S,
    runs_dir: RunsDirOpt = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
    settings: SetOpt = None,
    verbose: VerboseOpt = False,
) -> int:
    """Run the budget sweeps on the hosts (more repetitions than smoke) and report them."""
    options = build_options(budgets, batch_sizes, repeat, seed, settings)  # refused before anything is made
    if plot is not None:  # before the sweep, not after it
        from ddtree_ops.local_dirs import ensure_output_dir

        ensure_output_dir(plot, "--plot")
    # the thorough sweep: every point gets `--repeat` calls, however long that takes
    options.setdefault("extra", {}).setdefault("tree_bench_seconds", 0)
    return run_smoke(
        inventory=inventory, hosts=hosts, stages=_bench_stages(source, not no_push),
        options=options, keep_going=True,
        json_out=json_out, push=not no_push, source=source, stage_timeout_s=stage_timeout,
        runs_dir=runs_dir, parallel=parallel, accept_new_host_keys=accept_new_host_keys,
        command="bench", plot=plot, verbose=verbose)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
