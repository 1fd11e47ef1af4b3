"""`ddtree-ops push`: make the current ddtree release active on the selected hosts."""
from __future__ import annotations

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
    MaxFailOpt,
    ParallelOpt,
    SerialOpt,
    SourceOpt,
    rollout_policy,
    select_hosts,
)

DEFAULT_KEEP = 5  # = remote_layout.DEFAULT_KEEP


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n else "0"


def push(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    source: SourceOpt = None,
    keep: Annotated[int, typer.Option("--keep", min=1, help="Releases kept per host (the active one always).")] = DEFAULT_KEEP,
    json_out: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    fail_fast: FailFastOpt = False,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
    serial: SerialOpt = None,
    max_fail_percent: MaxFailOpt = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", "--check",
        help="Say per host what would be sent, activated and pruned, and the size; change nothing.")] = False,
) -> int:
    """Send the release (src/ddtree + ddtree_ops/hostside/) where it is missing, verify it, switch `current`."""
    from ddtree_ops.cli.console import run_on_hosts, say
    from ddtree_ops.release import build_bundle
    from ddtree_ops.remote_layout import PushAction, ensure_release

    policy = rollout_policy(serial, max_fail_percent)
    _, selected = select_hosts(inventory, hosts)
    bundle = build_bundle(source)
    if not json_out:
        say(f"{'plan for ' if dry_run else ''}release {bundle.described}: {len(bundle.files)} files, "
            f"{_size(bundle.total_bytes)} from {bundle.source_root}")
    options = FanoutOptions(inventory, hosts, json_out, parallel, fail_fast, accept_new_host_keys, policy)
    if dry_run:
        return _plan(selected, bundle, keep, options)

    def task(ctx: Any) -> Any:
        ctx.report(f"release {bundle.release_id}")
        return ensure_release(ctx.transport, ctx.host, bundle, keep=keep)

    return run_on_hosts(
        "push",
        selected,
        task,
        options,
        columns=["action", "release", "previous", "sent", "pruned", "left (not ours)"],
        row=lambda o: [
            o.value.action.value + (f" (replaced a damaged copy: {o.value.replaced_broken})"
                                    if o.value.replaced_broken else ""),
            o.value.release_id,
            o.value.previous or "-",
            _size(o.value.bytes_sent),
            str(len(o.value.pruned)),
            "; ".join(o.value.foreign) or "-",
        ],
        to_json=lambda outcome: outcome.to_dict(),
        extra_json={"release": bundle.release_id, "files": len(bundle.files), "source": bundle.source_root,
                    "release_git": bundle.git.to_dict() if bundle.git else None},
        while_running=bundle.archive,  # made while the hosts connect; only a host that lacks the release needs it
        changed=lambda o: o.ok and o.value.action is not PushAction.UNCHANGED,
    )


def _plan(selected: list[Any], bundle: Any, keep: int, options: FanoutOptions) -> int:
    from ddtree_ops.cli.console import run_on_hosts
    from ddtree_ops.remote_layout import plan_push

    def task(ctx: Any) -> Any:
        ctx.report(f"planning release {bundle.release_id}")
        return plan_push(ctx.transport, ctx.host, bundle, keep=keep)

    return run_on_hosts(
        "push",
        selected,
        task,
        options,
        columns=["would", "release", "previous", "send", "prune", "left (not ours)"],
        row=lambda o: [
            o.value.action + (f" (replacing a damaged copy: {o.value.replaces_broken})" if o.value.replaces_broken else ""),
            o.value.release_id,
            o.value.previous or "-",
            _size(o.value.bytes_to_send),
            ", ".join(o.value.pruned) or "-",
            "; ".join(o.value.foreign) or "-",
        ],
        to_json=lambda plan: plan.to_dict(),
        extra_json={"release": bundle.release_id, "files": len(bundle.files), "source": bundle.source_root,
                    "release_git": bundle.git.to_dict() if bundle.git else None,
                    "dry_run": True},
    )


def register(app: typer.Typer) -> None:
    app.command("push")(push)
