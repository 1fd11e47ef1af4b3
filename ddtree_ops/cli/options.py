"""Options shared by every command that works on hosts (one definition, one spelling).

Use them as parameter annotations:

    def push(inventory: InventoryOpt = None, hosts: HostsOpt = None, json_out: JsonOpt = False,
             parallel: ParallelOpt = DEFAULT_PARALLEL, fail_fast: FailFastOpt = False,
             accept_new_host_keys: AcceptNewHostKeysOpt = False) -> int: ...

then `FanoutOptions(...)` bundles them for `console.run_on_hosts`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:  # pragma: no cover - keeps pydantic out of `--help`
    from ddtree_ops.inventory import Host, Inventory
    from ddtree_ops.rollout import RolloutPolicy

DEFAULT_PARALLEL = 32  # = ddtree_ops.fanout.DEFAULT_PARALLEL (not imported: keeps --help light)

InventoryOpt = Annotated[
    Optional[Path],
    typer.Option(
        "-i",
        "--inventory",
        help="Inventory file (default: $DDTREE_OPS_INVENTORY, else ./hosts.yaml, else the embedded `local` host).",
        show_default=False,
    ),
]
HostsOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "-H", "--hosts", show_default=False,
        help="An Ansible host pattern: hosts, groups, ranges, wildcards joined by ',' (or ':'); "
             "'&group' intersects, '!host' excludes; repeatable (default: all)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout; progress and logs on stderr.")]
ParallelOpt = Annotated[int, typer.Option("--parallel", min=1, help="At most this many hosts at once.")]
FailFastOpt = Annotated[bool, typer.Option("--fail-fast", help="Start no new host after the first failure.")]
AcceptNewHostKeysOpt = Annotated[
    bool,
    typer.Option(
        "--accept-new-host-keys",
        help="Trust unknown host keys on first use and record them in known_hosts (a changed key is always refused).",
    ),
]

SerialOpt = Annotated[
    Optional[str],
    typer.Option(
        "--serial", metavar="SIZES",
        help="Roll out in batches, as Ansible's serial: host counts or percentages of the selection, "
             "e.g. 1,10%,100% (a canary, then 10%, then the rest; the last size repeats).",
        show_default=False,
    ),
]
MaxFailOpt = Annotated[
    Optional[str],
    typer.Option(
        "--max-fail-percent", metavar="P",
        help="Start no further batch once more than P% (0-100) of the hosts so far failed.",
        show_default=False,
    ),
]

SourceOpt = Annotated[
    Optional[Path],
    typer.Option("--source", help="Bundle this checkout instead of the ddtree ddtree-ops runs with.", show_default=False),
]


@dataclass(frozen=True)
class FanoutOptions:
    inventory: Optional[Path] = None
    hosts: Optional[list[str]] = None
    json: bool = False
    parallel: int = DEFAULT_PARALLEL
    fail_fast: bool = False
    accept_new_host_keys: bool = False
    rollout: Optional["RolloutPolicy"] = None  # --serial / --max-fail-percent; None: one batch


def rollout_policy(serial: Optional[str], max_fail_percent: Optional[str],
                   default_budget: Optional[float] = None) -> "RolloutPolicy":
    """The batches and the failure budget from --serial / --max-fail-percent (UsageError, exit 2);
    without --max-fail-percent, `default_budget` (None: every batch runs whatever fails)."""
    from ddtree_ops.rollout import NO_BUDGET, RolloutPolicy, parse_fail_percent, parse_serial

    budget = NO_BUDGET if default_budget is None else default_budget
    return RolloutPolicy(parse_serial(serial), parse_fail_percent(max_fail_percent, budget))


def select_hosts(inventory: Optional[Path], hosts: Optional[list[str]]) -> tuple["Inventory", list["Host"]]:
    """Load the inventory and pick the hosts named by -H (all when omitted)."""
    from ddtree_ops.inventory import load_inventory

    loaded = load_inventory(inventory)
    for note in loaded.notes:  # stderr: stdout may carry the one JSON document
        sys.stderr.write(f"ddtree-ops: note: {note}\n")
    return loaded, loaded.select(hosts)
