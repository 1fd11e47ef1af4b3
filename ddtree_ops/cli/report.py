"""`ddtree-ops report [RUN_ID]`: the host x stage table, each failure's reason, the budget
sweep; `--json` for scripts, `--baseline FILE` to compare named metrics (exit 5 on a
regression), `--plot DIR` for PNG charts. Also the renderer `smoke` and `bench` end with."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from ddtree_ops.report import Comparison, Report

_STATUS_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "not_run": "dim",
                 "running": "cyan"}
_OUTCOME_STYLE = {"pass": "green", "fail": "bold red", "lost": "bold red",
                  "unreachable": "bold red", "interrupted": "magenta", "pending": "dim"}

RunsDirOpt = Annotated[
    Optional[Path],
    typer.Option("--runs-dir", help="Local run store (default: $DDTREE_OPS_RUNS_DIR, else ./runs).",
                 show_default=False),
]


def _styled(text: str, styles: dict[str, str]) -> str:
    style = styles.get(text.split(" ")[0], "")
    return f"[{style}]{text}[/]" if style else text


def _ms(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def render_report(report: "Report", console: "Console") -> None:
    from rich.markup import escape
    from rich.table import Table

    from ddtree_ops.report import sweep_pivot

    table = Table(title=f"smoke run {report.run_id}", title_justify="left")
    table.add_column("host")
    table.add_column("outcome")
    for stage in report.stages:
        table.add_column(stage)
    for host in report.hosts:
        cells = []
        for stage in report.stages:
            status = report.statuses[host].get(stage)
            if status is None:
                cells.append("")
                continue
            seconds = report.durations[host].get(stage) or 0.0
            text = status if status in ("not_run",) else f"{status} {seconds:.1f}s"
            cells.append(_styled(text, _STATUS_STYLE))
        table.add_row(escape(host), _styled(report.outcomes[host].value, _OUTCOME_STYLE), *cells)
    console.print(table)
    for failure in report.failures:
        where = f"{failure.host}" + (f" / {failure.stage}" if failure.stage != "-" else "")
        console.print(f"[bold red]FAIL[/] {escape(where)}: {escape(failure.reason)}",
                      markup=True, highlight=False)
        if failure.detail and failure.detail not in failure.reason:
            console.print(f"      {failure.detail}", markup=False, highlight=False)
    skips = [(h, s, report.reasons[h][s]) for h in report.hosts for s in report.stages
             if report.statuses[h].get(s) == "skip"]
    for host, stage, reason in skips:
        console.print(f"[yellow]skip[/] {escape(host)} / {stage}: {escape(reason)}",
                      highlight=False)
    if report.sweep:
        builders, rows = sweep_pivot(report.sweep)
        sweep = Table(title="tree-bench: build time per request (ms, median)",
                      title_justify="left")
        for column in ("host", "batch", "budget", "nodes"):
            sweep.add_column(column, justify="right" if column != "host" else "left")
        for builder in builders:
            sweep.add_column(builder, justify="right")
        for row in rows:
            sweep.add_row(escape(str(row["host"])), str(row["batch_size"]), str(row["budget"]),
                          str(row.get("nodes", "-")), *[_ms(row.get(b)) for b in builders])
        console.print(sweep)
    if report.decode:
        decode = Table(title="decode-bench: per method", title_justify="left")
        for column in ("host", "method", "budget", "tau", "speedup", "ms/token", "same as AR"):
            decode.add_column(column, justify="left" if column in ("host", "method") else "right")
        for row in report.decode:
            tpot = row.get("time_per_output_token")
            same = row.get("identical_to_ar")
            decode.add_row(escape(str(row["host"])), escape(str(row.get("method"))),
                           str(row.get("budget") if row.get("budget") is not None else "-"),
                           _ms(row.get("tau")), _ms(row.get("speedup")),
                           _ms(tpot * 1e3) if isinstance(tpot, (int, float)) else "-",
                           f"{same:.0%}" if isinstance(same, (int, float)) else "-")
        console.print(decode)


def render_comparisons(comparisons: "list[Comparison]", console: "Console") -> None:
    from rich.markup import escape

    for item in comparisons:
        mark = "[green]ok[/]        " if item.ok else "[bold red]REGRESSION[/]"
        console.print(f"{mark} {escape(item.line())}", highlight=False)


def report(
    run_id: Annotated[Optional[str], typer.Argument(help="Run to report (default: the latest).",
                                                    show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    baseline: Annotated[Optional[Path], typer.Option(
        "--baseline", help="Compare named metrics with this file (exit 5 on a regression).",
        show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write PNG charts (tree-build time vs budget per host) into DIR.",
        show_default=False)] = None,
    runs_dir: RunsDirOpt = None,
) -> int:
    """Render a smoke run: status per host and stage, failures, the budget sweep."""
    from ddtree_ops.cli.console import emit_json, say, stdout_console
    from ddtree_ops.errors import ExitCode
    from ddtree_ops.report import build_report, compare_with_baseline, load_baseline, plot_run
    from ddtree_ops.results import RunStore, runs_root

    checks = load_baseline(baseline) if baseline is not None else None
    run = RunStore(runs_root(runs_dir)).load(run_id)
    model = build_report(run)
    comparisons = compare_with_baseline(run, checks) if checks is not None else []
    regressions = [c for c in comparisons if not c.ok]
    plots = [str(p) for p in plot_run(model, plot)] if plot is not None else []
    code = ExitCode.REMOTE if regressions else ExitCode.OK
    if json_out:
        document = model.to_dict()
        document["report_exit_code"] = int(code)
        if checks is not None:
            document["baseline"] = {"file": str(baseline),
                                    "comparisons": [c.to_dict() for c in comparisons],
                                    "regressions": len(regressions)}
        if plot is not None:
            document["plots"] = plots
        emit_json(document)
    else:
        console = stdout_console()
        render_report(model, console)
        if checks is not None:
            render_comparisons(comparisons, console)
        for path in plots:
            say(f"wrote {path}")
        if plot is not None and not plots:
            say("no tree-bench or decode-bench results in this run: nothing to plot")
    for item in regressions:
        say(f"regression: {item.line()}")
    return int(code)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
