"""`ddtree-ops collect RUN_ID`: fetch what the hosts kept for a run (event log, stage records,
stage logs, artifacts) that did not stream back, e.g. after a dropped connection, in one
stream per host. Idempotent and resumable: files already held (same size and sha256) are not
fetched again."""
from __future__ import annotations

from typing import Annotated, Any

import typer

from ddtree_ops.cli.options import (
    DEFAULT_PARALLEL,
    AcceptNewHostKeysOpt,
    FanoutOptions,
    HostsOpt,
    InventoryOpt,
    JsonOpt,
    ParallelOpt,
)
from ddtree_ops.cli.report import RunsDirOpt

COLLECT_TIMEOUT_S = 600.0  # one stream carries every missing file


def collect(
    run_id: Annotated[str, typer.Argument(help="The run to complete (see `ddtree-ops report`).")],
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    json_out: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
    max_gib: Annotated[float, typer.Option(
        "--max-gib", min=1e-6, max=1 << 20, help="Most a host may send in this collect (GiB); past it the host fails.")] = 8.0,
) -> int:
    """Fetch a run's remaining files from its hosts into runs/<run-id>/<host>/remote/ (one
    stream per host; files already held, by size and sha256, are not sent again)."""
    from ddtree_ops.cli.console import run_on_hosts, say
    from ddtree_ops.cli.options import select_hosts
    from ddtree_ops.errors import UsageError
    from ddtree_ops.results import RunStore, check_run_id, read_json, runs_root
    from ddtree_ops.run_fetch import collect_host_files

    check_run_id(run_id)  # a path part here and on the hosts: refused before anything else
    store = RunStore(runs_root(runs_dir))
    run = store.load(run_id)
    loaded, selected = select_hosts(inventory, hosts)
    in_run = [h for h in selected if h.name in run.hosts]
    if not in_run:
        chosen = "by -H" if hosts else f"in {loaded.source}"
        raise UsageError(f"run {run_id} has hosts {', '.join(run.hosts)}; none of them {chosen}")
    unknown = [name for name in run.hosts if name not in loaded.hosts]
    if unknown:  # said, not silently skipped: their files stay on those hosts
        say(f"collect: {len(unknown)} host(s) of run {run_id} are not in {loaded.source}, not collected: "
            f"{', '.join(unknown)}")

    def task(ctx: Any) -> Any:
        host_dir = run.path / ctx.host.name
        workdir = read_json(host_dir / "run.json").get("workdir") or ctx.host.workdir
        return collect_host_files(ctx.transport, ctx.host, str(workdir).rstrip("/"), run_id, host_dir,
                                  COLLECT_TIMEOUT_S, max_bytes=int(max_gib * (1 << 30)))

    return run_on_hosts(
        "collect", in_run, task,
        FanoutOptions(None, hosts, json_out, parallel, False, accept_new_host_keys),
        columns=["fetched", "unchanged", "events"],
        row=lambda o: [str(len(o.value.fetched)), str(o.value.unchanged),
                       "adopted host's" if o.value.merged_events else "kept"],
        to_json=lambda value: value.to_dict(),
        extra_json={"run_id": run_id},
    )


def register(app: typer.Typer) -> None:
    app.command("collect")(collect)
