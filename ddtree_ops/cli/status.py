"""`ddtree-ops status`: what serves on each host, and whether DDTree still accepts there what
the host accepted when it was qualified (ddtree_ops.server_status).

Exit codes: 0 ok (or nothing to judge: no server, DDTree off, little traffic, no reference;
the note says which) · 2 bad arguments · 3 bad inventory · 4 no host reachable · 5 a host's
live acceptance is below its reference by more than the tolerance (or it could not be read) ·
6 some hosts so, others fine. `--watch` polls until Ctrl-C (130) or `--count` polls, and
returns the last poll's code.
"""
from __future__ import annotations

import threading
import time
from typing import Annotated, Any, Optional

import typer

from ddtree_ops.cli.options import DEFAULT_PARALLEL, AcceptNewHostKeysOpt, FanoutOptions, HostsOpt, InventoryOpt, \
    JsonOpt, ParallelOpt
from ddtree_ops.cli.report import RunsDirOpt
from ddtree_ops.tolerances import DEFAULT_MIN_REQUEST_ROUNDS, DEFAULT_TAU_TOLERANCE

COLUMNS = ["sglang", "plugin", "ddtree", "server", "live acceptance", "reference", "verdict"]


def _number(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def row(facts: dict[str, Any]) -> list[str]:
    """The table cells of one host's status (its `to_dict()`, also what a failed host carries)."""
    deployed, ddtree, server = facts.get("deployed") or {}, facts.get("ddtree") or {}, facts.get("server") or {}
    live, reference = facts.get("live") or {}, facts.get("reference") or {}
    plugin = (f"{deployed.get('release')} ({deployed.get('deployed_at') or '?'})" if deployed.get("record")
              else "none")
    known = ddtree.get("enabled") is not None
    on = (f"on, budget {ddtree.get('budget')}" if ddtree.get("enabled") else "off") if known else "-"
    if known and ddtree.get("from") != "the server":
        on += f" (as deployed: {ddtree.get('from')})"
    acceptance = (f"{_number(live.get('acceptance_length'))} over {live.get('request_rounds')} request-rounds"
                  if live.get("ddtree") else "-")
    verdict = facts.get("verdict") or "-"
    if facts.get("note") and verdict != "below reference":  # a failed host's error column says why
        verdict += f": {facts['note']}"
    state = str(server.get("state", "?")).replace("-", " ")
    return [facts.get("sglang") or "absent", plugin, on, f":{server.get('port')} {state}", acceptance,
            f"{_number(reference.get('acceptance_length'))} ({reference.get('described')})" if reference else "-",
            verdict]


def status(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    port: Annotated[Optional[int], typer.Option(
        "--port", min=1, max=65535, show_default=False,
        help="The SGLang server's HTTP port on every host (default: each host's `sglang_port:`, else 30000).")] = None,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", min=0.0,
        help="Tokens per round the live acceptance may fall below the host's reference before it fails.")]
    = DEFAULT_TAU_TOLERANCE,
    min_request_rounds: Annotated[int, typer.Option(
        "--min-request-rounds", min=1, help="Judge a server only once it verified this many request-rounds.")]
    = DEFAULT_MIN_REQUEST_ROUNDS,
    runs_dir: RunsDirOpt = None,
    json_out: JsonOpt = False,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Poll again every --interval seconds until Ctrl-C: a live table at a terminal, a table "
                        "per poll in a pipe, one JSON document per line with --json.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.5, help="Seconds between two polls (--watch).")] = 5.0,
    count: Annotated[int, typer.Option("--count", min=0, help="With --watch: stop after this many polls (0: never).")] = 0,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
) -> int:
    """Per host: the SGLang installed, the plugin release deployed, DDTree on or off and its budget, and the
    serving SGLang's live acceptance (its /metrics, read on the host's loopback over SSH) beside the host's
    qualification or latest passing sglang-e2e at that budget."""
    from ddtree_ops.cli.console import run_on_hosts
    from ddtree_ops.cli.options import select_hosts
    from ddtree_ops.results import runs_root
    from ddtree_ops.server_status import fetch, find_reference, host_status, judge

    _, selected = select_hosts(inventory, hosts)
    root = runs_root(runs_dir)
    references: dict[tuple[str, int], Any] = {}  # read from the run store once per command
    references_lock = threading.Lock()

    def reference_for(host: str, budget: int) -> Any:
        with references_lock:
            if (host, budget) not in references:
                references[(host, budget)] = find_reference(root, host, budget)
            return references[(host, budget)]

    def task(ctx: Any) -> Any:
        where = port or ctx.host.sglang_port
        ctx.report(f"reading 127.0.0.1:{where}/metrics on the host")
        found = host_status(ctx.host, where, fetch(ctx.transport, ctx.host, where))
        live = found.live
        reference = reference_for(ctx.host.name, live.budget) if live and live.ddtree and live.budget else None
        return judge(found, ctx.host.name, reference, tolerance, min_request_rounds)

    options = FanoutOptions(inventory, hosts, json_out, parallel, False, accept_new_host_keys)
    extra = {"tolerance": tolerance, "min_request_rounds": min_request_rounds, "runs_dir": str(root)}
    if watch:
        return watch_hosts(selected, task, options, interval, count, extra)
    return run_on_hosts("status", selected, task, options, columns=COLUMNS, row=lambda o: row(_facts(o)),
                        to_json=lambda value: value.to_dict(), extra_json=extra)


def _facts(outcome: Any) -> dict[str, Any]:
    return outcome.value.to_dict() if outcome.ok else outcome.error.details


def watch_hosts(selected: list[Any], task: Any, options: FanoutOptions, interval: float, count: int,
                extra: dict[str, Any]) -> int:
    """Poll until Ctrl-C or `count` polls. At a terminal one table is redrawn in place (drawn
    here, in this thread, from a finished poll: nothing else touches it meanwhile); in a pipe
    a table per poll; with --json one document per line. Returns the last poll's exit code."""
    from contextlib import nullcontext

    from ddtree_ops.cli.console import emit_json, fanout_document, live_display_possible, stdout_console, \
        summary_table
    from ddtree_ops.fanout import run_fanout

    console = stdout_console()
    live = None
    if not options.json and live_display_possible(console):
        from rich.live import Live

        live = Live(console=console, auto_refresh=False)  # redrawn by us after each poll, not by a thread
    polls, code = 0, 0
    with live if live is not None else nullcontext():
        while True:
            started = time.monotonic()
            result = run_fanout(selected, task, parallel=options.parallel,
                                accept_new_host_keys=options.accept_new_host_keys)
            code, polls = int(result.exit_code()), polls + 1
            when = time.strftime("%H:%M:%S")
            if options.json:
                emit_json({**fanout_document("status", result, started, lambda v: v.to_dict(), extra),
                           "poll": polls, "time": when}, one_line=True)
            else:
                title = f"status at {when}, poll {polls}" + (f" of {count}" if count else "") + \
                        f" (every {interval:g}s; Ctrl-C stops)"
                table = summary_table(title, result, COLUMNS, lambda o: row(_facts(o)))
                if live is not None:
                    live.update(table, refresh=True)
                else:
                    console.print(table)
            if count and polls >= count:
                return code
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


def register(app: typer.Typer) -> None:
    app.command("status")(status)
