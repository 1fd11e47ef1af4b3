"""`ddtree-ops deploy` / `ddtree-ops rollback`: the SGLang plugin in the hosts' Python environments."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ddtree_ops.cli.options import (
    DEFAULT_PARALLEL,
    AcceptNewHostKeysOpt,
    FailFastOpt,
    FanoutOptions,
    HostsOpt,
    InventoryOpt,
    JsonOpt,
    ParallelOpt,
    SourceOpt,
    select_hosts,
)


def _note(outcome: Any) -> str:
    """Reasons (probe), else gate findings, else for a plan the files it would add."""
    if outcome.reasons or outcome.gate_findings:
        return "; ".join(outcome.reasons or outcome.gate_findings)[:200]
    if outcome.action.startswith("would"):
        return "adds " + ", ".join(Path(p).name for p in outcome.adds)
    return ""


def deploy(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing on any host.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Deploy despite gate findings (unknown SGLang version, changed files); recorded.")
    ] = False,
    source: SourceOpt = None,
    json_out: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    fail_fast: FailFastOpt = False,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
) -> int:
    """Install the DDTree SGLang plugin (entry point sglang.srt.plugins:ddtree) into each host's `python:`
    environment: gate, install, verify in a fresh interpreter, record what was added."""
    from ddtree_ops.cli.console import run_on_hosts, say
    from ddtree_ops.deploy import deploy_host
    from ddtree_ops.release import build_bundle

    _, selected = select_hosts(inventory, hosts)
    bundle = build_bundle(source)
    if not json_out:
        say(f"{'plan for ' if dry_run else ''}release {bundle.release_id}{' (--force)' if force else ''}")

    def task(ctx: Any) -> Any:
        ctx.report("planning" if dry_run else "deploying")
        return deploy_host(ctx.transport, ctx.host, bundle, force=force, dry_run=dry_run)

    return run_on_hosts(
        "deploy",
        selected,
        task,
        FanoutOptions(inventory, hosts, json_out, parallel, fail_fast, accept_new_host_keys),
        columns=["action", "sglang", "verdict", "forced", "note"],
        row=lambda o: [
            o.value.action,
            o.value.sglang,
            o.value.verdict,
            "yes" if o.value.forced else "no",
            _note(o.value),
        ],
        to_json=lambda outcome: outcome.to_dict(),
        extra_json={"release": bundle.release_id, "dry_run": dry_run, "force": force},
        while_running=bundle.archive,
    )


def rollback(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    source: SourceOpt = None,
    json_out: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    fail_fast: FailFastOpt = False,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
) -> int:
    """Remove exactly what `deploy` added to each host's environment (and finish an interrupted deploy's cleanup)."""
    from ddtree_ops.cli.console import run_on_hosts
    from ddtree_ops.deploy import rollback_host
    from ddtree_ops.release import build_bundle

    _, selected = select_hosts(inventory, hosts)
    bundle = build_bundle(source)

    def task(ctx: Any) -> Any:
        ctx.report("rolling back")
        return rollback_host(ctx.transport, ctx.host, bundle)

    return run_on_hosts(
        "rollback",
        selected,
        task,
        FanoutOptions(inventory, hosts, json_out, parallel, fail_fast, accept_new_host_keys),
        columns=["action", "release", "removed", "modified"],
        row=lambda o: [o.value.action, o.value.release or "-", str(len(o.value.removed)),
                       str(len(o.value.modified_since_deploy))],
        to_json=lambda outcome: outcome.to_dict(),
    )


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)
    app.command("rollback")(rollback)
