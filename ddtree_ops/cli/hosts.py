"""`ddtree-ops hosts list` (the resolved inventory) and `hosts check` (what each host has)."""
from __future__ import annotations

import sys
from enum import Enum
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
    select_hosts,
)
from ddtree_ops.errors import RemoteStepError

hosts_app = typer.Typer(help="Inspect the inventory and the hosts in it.", no_args_is_help=True)


class HostNotReady(RemoteStepError):
    """The probe ran, but the host lacks something a release needs (e.g. torch)."""

    def __init__(self, message: str, details: dict[str, Any]):
        super().__init__(message)
        self.details = details


class ListFormat(str, Enum):
    TABLE = "table"
    ANSIBLE = "ansible"


@hosts_app.command("list")
def list_hosts(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    json_out: JsonOpt = False,
    output_format: Annotated[ListFormat, typer.Option(
        "--format", help="table, or ansible: the hosts as an Ansible YAML inventory on stdout "
                         "(for ansible-playbook -i / AWX).")] = ListFormat.TABLE,
) -> int:
    """Print the resolved inventory (defaults applied, ssh_config not yet consulted)."""
    from rich.table import Table

    from ddtree_ops.cli.console import emit_json, say, stdout_console

    loaded, selected = select_hosts(inventory, hosts)
    if output_format is ListFormat.ANSIBLE and not json_out:
        import yaml

        from ddtree_ops.ansible_inventory import export

        sys.stdout.write(f"# Ansible inventory of {len(selected)} host(s) from {loaded.source} (ddtree-ops hosts list --format ansible)\n")
        sys.stdout.write(yaml.safe_dump(export(selected), sort_keys=False))
        return 0
    if json_out:
        emit_json(
            {
                "inventory": loaded.source,
                "hosts": {
                    h.name: {
                        "transport": h.transport.value,
                        "hostname": h.hostname,
                        "user": h.user,
                        "port": h.port,
                        "python": h.python,
                        "workdir": h.workdir,
                        "groups": list(h.groups),
                        "identity_file": h.identity_file,
                        "known_hosts": h.known_hosts,
                        "ssh_config": h.ssh_config,
                        "connect_timeout": h.connect_timeout,
                        "command_timeout": h.command_timeout,
                        "models": h.models.to_dict() if h.models else None,
                        "sglang_port": h.sglang_port,
                    }
                    for h in selected
                },
            }
        )
        return 0
    columns = ("host", "transport", "target", "python", "workdir", "groups", "timeouts")
    rows = [(h.name, h.transport.value, h.target(), h.python, h.workdir, ",".join(h.groups),
             f"{h.connect_timeout:g}s/{h.command_timeout:g}s") for h in selected]
    if len(rows) > RICH_TABLE_MAX_ROWS:
        _plain_table(f"hosts ({loaded.source})", columns, rows)
    else:
        table = Table(title=f"hosts ({loaded.source})", title_justify="left")
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        stdout_console().print(table)
    say(f"{len(selected)} host(s) from {loaded.source}")
    return 0


# Rich lays out a table at about 0.4 ms a row: past this many, plain columns (a 100k-host
# inventory lists in a second, not a minute).
RICH_TABLE_MAX_ROWS = 2000


def _plain_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Left-aligned columns two spaces apart, every cell inert, one line a host."""
    from ddtree_ops.cli.console import inert

    cells = [columns] + [tuple(inert(c, one_line=True) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    out = sys.stdout
    out.write(inert(title, one_line=True) + "\n")
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def _gib(value: Any) -> str:
    return f"{value:g} GiB" if isinstance(value, (int, float)) else "?"


def check_row(facts: dict[str, Any]) -> list[str]:
    torch = facts.get("torch", {})
    sglang = facts.get("sglang", {})
    if torch.get("installed"):
        torch_text = torch.get("version", "?")
        gpus = torch.get("gpus", [])
        if gpus:
            cuda_text = ", ".join(f"{g['name']} {_gib(g['memory_gib'])}" for g in gpus)
        elif torch.get("cuda_error"):
            cuda_text = f"CUDA error: {torch['cuda_error']}"
        else:
            cuda_text = f"none ({torch['gpu_note']})" if torch.get("gpu_note") else "none"
        if torch.get("cuda_build"):
            torch_text += f" (CUDA {torch['cuda_build']}{', available' if torch.get('cuda_available') else ''})"
    else:
        torch_text, cuda_text = "MISSING", "-"
    sglang_text = f"{sglang.get('version') or '?'} ({sglang.get('path')})" if sglang.get("installed") else "absent"
    if sglang.get("plugins_problem"):
        sglang_text += f"; {sglang['plugins_problem']}"
    return [
        f"{facts.get('os', '?')} / {facts.get('kernel', '?')}",
        facts.get("python", {}).get("version", "?"),
        torch_text,
        cuda_text,
        sglang_text,
        _gib(facts.get("disk", {}).get("free_gib")),
        _release_text(facts),
    ]


def _release_text(facts: dict[str, Any]) -> str:
    problem = facts.get("release_problem")
    release = facts.get("active_release") or "none"
    return f"{release} (damaged: {problem}; the next push replaces it)" if problem else release


CHECK_COLUMNS = ["os / kernel", "python", "torch", "gpus", "sglang", "free disk", "release"]


def check_task(ctx: Any, deep: bool = False) -> dict[str, Any]:
    from ddtree_ops.remote_layout import probe_host

    ctx.report(f"probing with {ctx.host.python}")
    facts = probe_host(ctx.transport, ctx.host, deep=deep, timeout=ctx.host.command_timeout)
    from ddtree.sglang.config import plugins_filter_problem

    sglang = facts.get("sglang", {})
    sglang["plugins_problem"] = plugins_filter_problem(sglang.get("plugins_env"))
    torch = facts.get("torch", {})
    if not torch.get("installed"):
        raise HostNotReady(
            f"{ctx.host.name}: torch is not importable by {ctx.host.python} ({torch.get('error', 'unknown error')})",
            facts,
        )
    return facts


@hosts_app.command("check")
def check(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    json_out: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    fail_fast: FailFastOpt = False,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
    deep: Annotated[
        bool, typer.Option("--deep", help="Import torch on each host and ask torch.cuda (slower; catches broken installs).")
    ] = False,
) -> int:
    """One process of each host's Python reports OS, Python, torch, CUDA/GPUs, SGLang, disk, release.

    By default torch is located without importing it (version and CUDA build from its files,
    GPUs from nvidia-smi); `--deep` imports it and asks torch.cuda."""
    from ddtree_ops.cli.console import run_on_hosts

    _, selected = select_hosts(inventory, hosts)
    options = FanoutOptions(inventory, hosts, json_out, parallel, fail_fast, accept_new_host_keys)
    return run_on_hosts(
        "hosts check",
        selected,
        lambda ctx: check_task(ctx, deep),
        options,
        columns=CHECK_COLUMNS,
        row=lambda outcome: check_row(outcome.value if outcome.ok else outcome.error.details),
    )


def register(app: typer.Typer) -> None:
    app.add_typer(hosts_app, name="hosts")
