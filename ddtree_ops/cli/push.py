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


def _files(count: int, size: int, reused: int) -> str:
    """`1 file, 0.4 KiB (80 reused)`: what went over the wire, and what the host copied itself."""
    sent = f"{count} file{'' if count == 1 else 's'}, {_size(size)}" if count else "0"
    return sent + (f" ({reused} reused)" if reused else "")


def _action(text: str, broken: Any, rejected: tuple[str, ...], replacing: bool = False) -> str:
    """The action, with why a copy on the host was (or, in a plan, would be) replaced or not used."""
    return (text + (f" ({'replacing' if replacing else 'replaced'} a damaged copy: {broken})" if broken else "")
            + (f" (held copies not used: {'; '.join(rejected)})" if rejected else ""))


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
    """Send the release (src/ddtree + ddtree_ops/hostside/): only the files a host does not hold; verify, switch `current`."""
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
            _action(o.value.action.value, o.value.replaced_broken, o.value.reuse_rejected),
            o.value.release_id,
            o.value.previous or "-",
            _files(o.value.files_sent, o.value.bytes_sent, o.value.files_reused),
            str(len(o.value.pruned)),
            "; ".join(o.value.foreign) or "-",
        ],
        to_json=lambda outcome: outcome.to_dict(),
        extra_json={"release": bundle.release_id, "files": len(bundle.files), "source": bundle.source_root,
                    "release_git": bundle.git.to_dict() if bundle.git else None},
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
            _action(o.value.action, o.value.replaces_broken, o.value.reuse_rejected, replacing=True),
            o.value.release_id,
            o.value.previous or "-",
            _files(o.value.files_to_send, o.value.bytes_to_send, o.value.files_to_reuse),
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
