"""`ddtree-ops report [RUN_ID]`: the host x stage table, each failure's reason, the budget
sweep and decode-bench tables; `--json` for scripts, `--baseline FILE` to compare with a
metrics baseline or a decode baseline (told apart by content; exit 5 on a regression, 6 when
no regression was found but a timed value was too noisy to judge, 3 for a file that is neither), `--plot DIR` for PNG charts. Also the renderer `smoke` and `bench` end with."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ddtree_ops.cli.console import inert, styled, without_host
from ddtree_ops.tolerances import DEFAULT_ACCEPTANCE_TOLERANCE, DEFAULT_TAU_TOLERANCE

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from ddtree_ops.report.decode_checks import DecodeComparison
    from ddtree_ops.report.metric_checks import MetricComparison
    from ddtree_ops.report.server_checks import ServerComparison
    from ddtree_ops.report.model import Report

_STATUS_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "not_run": "dim", "lost": "bold red",
                 "missing": "bold red", "running": "cyan"}
_OUTCOME_STYLE = {"pass": "green", "fail": "bold red", "lost": "bold red",
                  "unreachable": "bold red", "host key refused": "bold red", "interrupted": "magenta", "pending": "dim",
                  "refused": "bold red"}

RunsDirOpt = Annotated[
    Optional[Path],
    typer.Option("--runs-dir", help="Local run store (default: $DDTREE_OPS_RUNS_DIR, else ./runs).",
                 show_default=False),
]


def _styled(text: str, styles: dict[str, str]) -> Any:
    return styled(text, styles.get(text.split(" ")[0], ""))


_VERDICT_MARK = {"ok": ("ok", "green"), "regression": ("REGRESSION", "bold red"),
                 "outside tolerance": ("OUTSIDE TOLERANCE", "bold red"),
                 "not checked": ("not checked", "yellow"), "not judged": ("not judged", "yellow"),
                 None: ("-", "dim")}


def _mark(verdict: Optional[str], width: int = 0) -> Any:
    word, style = _VERDICT_MARK[verdict]
    return styled(word.ljust(width), style)


def _ratio(slow: Any, fast: Any) -> str:
    """slow / fast as `2.31x`, measured in the same run; `-` when either is missing."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (slow, fast))
    return f"{slow / fast:.2f}x" if numbers and fast > 0 else "-"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def column_format(values: list[Any], suffix: str = "") -> Any:
    """One number format for a whole column: as many decimals as its largest value needs for
    three significant digits (0.12 beside 12.30, never 0.123 beside 12.3); `-` for none."""
    largest = max((abs(v) for v in values if _is_number(v)), default=0.0)
    decimals = 3 if largest < 10 else 2 if largest < 100 else 1 if largest < 1000 else 0

    def shown(value: Any) -> str:
        if not _is_number(value):
            return "-" if value is None else str(value)
        return f"{value:.{decimals}f}{suffix}"

    return shown


def _noisy(text: str, noisy: bool) -> Any:
    """A table cell, marked `noisy` (ddtree_ops/noise.py) when its figure cannot be trusted."""
    if not noisy:
        return text
    from rich.text import Text

    return Text.assemble(text, " ", styled("noisy", "yellow"))


SWEEP_NOTES = (
    "batch: requests per call; budget: draft-tree nodes asked for; nodes: nodes in the tree (batch 1)",
    "heap: the reference-exact heap builder; public: build_ddtree_tree_from_logits, the default; batched: one "
    "call for the whole batch; graphed: batched, replayed as a CUDA graph",
    "floor: torch.topk(k=budget) + logsumexp over the same logits: the least any builder pays",
    "heap/public: heap time / public time (medians of the same run): how much faster the public builder is",
)
DECODE_NOTE = ("tau: tokens accepted per target forward; speedup: AR's time per output token / the method's "
               "(same run); ms/token: mean time per output token; same as AR: share of requests "
               "token-identical to autoregressive at T=0")
NOISY_NOTE = ("noisy: the median cannot be trusted: fewer than {samples} samples, the cell's samples spread over "
              "more than {spread:.0%} of it, or the host was busy (load per CPU > {load:g}, or GPU > {gpu:g}% busy before the stage)")


def render_report(report: "Report", console: "Console") -> None:
    from rich.table import Table

    from ddtree_ops.report.model import sweep_pivot

    command = report.meta.get("command") or "smoke"
    table = Table(title=f"{command} run {report.run_id}", title_justify="left")
    table.add_column("host", overflow="fold")
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
            if status == "lost":
                text = f"lost (ran {seconds:.0f}s)"
            else:
                text = status if status in ("not_run", "missing") else f"{status} {seconds:.1f}s"
            cells.append(_styled(text, _STATUS_STYLE))
        table.add_row(host, _styled(report.outcomes[host].value, _OUTCOME_STYLE), *cells)
    console.print(table)
    for failure in report.failures:
        where = f"{failure.host}" + (f" / {failure.stage}" if failure.stage != "-" else "")
        reason = without_host(failure.host, failure.reason)
        console.print(styled("FAIL", "bold red"), inert(f"{where}: {reason}", one_line=True),
                      soft_wrap=True)  # one line, however long
        if failure.detail and failure.detail not in failure.reason:
            console.print(f"      {failure.detail}", soft_wrap=True)
    for host, history in report.histories.items():
        console.print(styled("lost", "bold red"), inert(lost_history_line(host, history, report.meta), one_line=True),
                      soft_wrap=True)
    skips = [(h, s, report.reasons[h][s]) for h in report.hosts for s in report.stages
             if report.statuses[h].get(s) == "skip"]
    for host, stage, reason in skips:
        console.print(styled("skip", "yellow"), inert(f"{host} / {stage}: {reason}", one_line=True),
                      soft_wrap=True)
    noisy_seen = False
    if report.sweep:
        builders, rows = sweep_pivot(report.sweep)
        sweep = Table(title="tree-bench: build time per request (ms, median)",
                      title_justify="left")
        for column in ("host", "batch", "budget", "nodes"):
            sweep.add_column(column, justify="right" if column != "host" else "left")
        for builder in builders:
            sweep.add_column(str(builder), justify="right")
        speedup = "heap" in builders and "public" in builders  # the public builder vs the oracle
        if speedup:
            sweep.add_column("heap/public", justify="right")
        formats = {b: column_format([row.get(b) for row in rows]) for b in builders}
        for row in rows:
            noisy = set(row.get("noisy_builders", ()))
            noisy_seen |= bool(noisy)
            cells = [_noisy(formats[b](row.get(b)), b in noisy) for b in builders]
            if speedup:  # a ratio of noisy medians is no steadier than they are
                cells.append(_noisy(_ratio(row.get("heap"), row.get("public")), bool({"heap", "public"} & noisy)))
            sweep.add_row(str(row["host"]), str(row["batch_size"]), str(row["budget"]),
                          str(row.get("nodes", "-")), *cells)
        console.print(sweep)
        for note in SWEEP_NOTES:
            console.print(f"  {note}", soft_wrap=True)
    if report.decode:
        decode = Table(title="decode-bench: per method", title_justify="left")
        for column in ("host", "method", "budget", "tau", "speedup", "ms/token", "same as AR"):
            decode.add_column(column, justify="left" if column in ("host", "method") else "right")
        tpots = [row["time_per_output_token"] * 1e3 if _is_number(row.get("time_per_output_token")) else None
                 for row in report.decode]
        tau_shown = column_format([row.get("tau") for row in report.decode])
        speedup_shown = column_format([row.get("speedup") for row in report.decode], "x")
        tpot_shown = column_format(tpots)
        for row, tpot in zip(report.decode, tpots):
            same = row.get("identical_to_ar")
            noisy = bool(row.get("noisy"))
            noisy_seen |= noisy
            decode.add_row(str(row["host"]), str(row.get("method")),
                           str(row.get("budget") if row.get("budget") is not None else "-"),
                           tau_shown(row.get("tau")), _noisy(speedup_shown(row.get("speedup")), noisy),
                           _noisy(tpot_shown(tpot), noisy),
                           f"{same:.0%}" if isinstance(same, (int, float)) else "-")
        console.print(decode)
        console.print(f"  {DECODE_NOTE}", soft_wrap=True)
    if noisy_seen:
        from ddtree_ops.noise import GPU_BUSY_LIMIT_PCT, LOAD_PER_CPU_LIMIT, MIN_SAMPLES, SPREAD_LIMIT

        console.print("  " + NOISY_NOTE.format(samples=MIN_SAMPLES, spread=SPREAD_LIMIT, load=LOAD_PER_CPU_LIMIT, gpu=GPU_BUSY_LIMIT_PCT),
                      soft_wrap=True)
    render_loads(report, console)


RECOMMEND_NOTE = ("deploy: the fastest variant per concurrency level in sglang-e2e's load runs; undecided when "
                  "a variant is missing, the host was busy, or the runner-up of another kind is within 5% "
                  "(one measurement per cell). vs no spec / vs DFlash: its tokens/s over theirs at that level.")
PREDICT_NOTE = ("predicted: decode-bench's throughput model (verify cost of HF forwards on this host, tau from "
                "its decodes); measured: sglang-e2e. error: predicted / measured - 1 (SGLang's kernels are "
                "faster than HF forwards: compare rankings, not absolute values).")


def render_recommendations(recommendations: list[Any], predictions: list[dict[str, Any]], console: "Console") -> None:
    from rich.table import Table

    if recommendations:
        table = Table(title="recommendation: which variant pays at each load", title_justify="left")
        for column in ("host", "concurrent", "deploy", "budget", "tokens/s", "vs no spec", "vs DFlash", "why"):
            table.add_column(column, justify="left" if column in ("host", "deploy", "why") else "right",
                             overflow="fold")
        speeds = column_format([r.tokens_per_s for r in recommendations])
        versus = column_format([r.speedup_vs_no_spec for r in recommendations]
                               + [r.speedup_vs_dflash for r in recommendations], "x")
        for r in recommendations:
            table.add_row(r.host, str(r.concurrency), r.choice.value, "-" if r.budget is None else str(r.budget),
                          speeds(r.tokens_per_s), versus(r.speedup_vs_no_spec), versus(r.speedup_vs_dflash), r.why)
        console.print(table)
        console.print(f"  {RECOMMEND_NOTE}", soft_wrap=True)
    if predictions:
        table = Table(title="throughput model: predicted beside measured (tokens/s)", title_justify="left")
        for column in ("host", "concurrent", "variant", "predicted", "measured", "error"):
            table.add_column(column, justify="left" if column in ("host", "variant") else "right")
        predicted = column_format([r["predicted_tokens_per_s"] for r in predictions])
        measured = column_format([r["measured_tokens_per_s"] for r in predictions])
        for r in predictions:
            table.add_row(r["host"], str(r["concurrency"]), str(r["variant"]), predicted(r["predicted_tokens_per_s"]),
                          measured(r["measured_tokens_per_s"]), f"{r['error']:+.0%}")
        console.print(table)
        console.print(f"  {PREDICT_NOTE}", soft_wrap=True)


def _clock(stamp: Any) -> str:
    import time

    if not _is_number(stamp):
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))


def lost_history_line(host: str, history: dict[str, Any], run_meta: dict[str, Any]) -> str:
    """What happened to a host lost during the run, then and since, in one line."""
    parts = [f"{host}: lost at {_clock(history.get('lost_at'))}"]
    if _is_number(history.get("silent_s")):
        parts[0] += f" after {history['silent_s']:.0f}s of silence"
    ran = []
    if _is_number(history.get("ran_s")):
        ran.append(f"its runner had run {history['ran_s']:.0f}s")
    if history.get("stage") and _is_number(history.get("stage_ran_s")):
        ran.append(f"{history['stage']} {history['stage_ran_s']:.0f}s")
    if ran:
        parts.append(", ".join(ran))
    if history.get("completed_on_host"):
        parts.append(f"the runner then finished on the host: {history['completed_on_host']} "
                     f"(exit {history.get('host_exit_code')}) at {_clock(history.get('finished_on_host_at'))}")
    else:
        parts.append("no result from the host since (`ddtree-ops collect` fetches what it finished)")
    if history.get("collected_at"):
        parts.append(f"collected at {_clock(history['collected_at'])}")
    if run_meta.get("exit_code") is not None:
        parts.append(f"the run exited {run_meta['exit_code']}")
    return "; ".join(parts)


def render_loads(report: "Report", console: "Console") -> None:
    """One line per timed stage of each host: its load before -> after, and why it was noisy."""
    from ddtree_ops.noise import describe_load, load_problem

    for host in report.hosts:
        for stage, load in report.loads.get(host, {}).items():
            problem = load_problem(load)
            line = inert(f"load {host} / {stage}: {describe_load(load)}", one_line=True)
            if problem:
                console.print(line, styled("noisy", "yellow"), inert(f"({problem})", one_line=True), soft_wrap=True)
            else:
                console.print(line, soft_wrap=True)


def render_comparisons(comparisons: "list[MetricComparison]", console: "Console") -> None:
    for item in comparisons:
        console.print(_mark(item.verdict, 10), inert(item.line(), one_line=True))


def render_decode_comparison(comparison: "DecodeComparison", console: "Console") -> None:
    from rich.table import Table

    table = Table(title=f"decode-bench vs baseline (tau ± {comparison.tau_tolerance:g})",
                  title_justify="left")
    for column in ("host", "method", "budget", "tau", "baseline tau", "speedup", "baseline speedup",
                   "same as AR", "baseline cell", "verdict"):
        table.add_column(column, justify="left" if column in ("host", "method", "baseline cell", "verdict")
                         else "right")
    tau_shown = column_format([v for row in comparison.rows for v in (row.get("tau"), row.get("baseline_tau"))])
    speedup_shown = column_format([v for row in comparison.rows
                                   for v in (row.get("speedup"), row.get("baseline_speedup"))], "x")
    for row in comparison.rows:
        same = row.get("identical_to_ar")
        table.add_row(str(row["host"]), str(row["method"]),
                      "-" if row.get("budget") is None else str(row["budget"]),
                      tau_shown(row.get("tau")), tau_shown(row.get("baseline_tau")),
                      speedup_shown(row.get("speedup")), speedup_shown(row.get("baseline_speedup")),
                      f"{same:.0%}" if isinstance(same, (int, float)) else "-",
                      row.get("baseline_cell") or "no cell", _mark(row.get("verdict")))
    console.print(table)
    for item in comparison.checks:
        console.print(_mark(item.verdict, 10), inert(item.line(), one_line=True))
    for note in comparison.notes:
        console.print(styled("note", "yellow"), inert(note, one_line=True))


SERVER_NOTE = ("server: SGLang's per-request histograms (accepted tokens per verify round, bonus included); "
               "offline: the offline loop on the same prompts, method, budget and draft block, following the server's tokens (equal / near-tie / "
               "mismatch: requests); decode-bench and baseline: tau of the same method. Below any by more than the "
               "tolerance: a regression.")


def render_server_comparison(comparison: "ServerComparison", console: "Console") -> None:
    from rich.table import Table

    if not comparison.rows:
        return
    table = Table(title=f"sglang-e2e acceptance vs offline (tolerance {comparison.tolerance:g} below)",
                  title_justify="left")
    for column in ("host", "method", "budget", "server", "offline", "requests =/~/x", "decode-bench",
                   "baseline", "verdict"):
        table.add_column(column, justify="left" if column in ("host", "method", "verdict") else "right")
    shown = column_format([v for row in comparison.rows for v in (
        row.get("acceptance_length"), row.get("offline_acceptance_length"), row.get("decode_bench_tau"),
        row.get("baseline_tau"))])
    for row in comparison.rows:
        counts = [row.get(k) for k in ("acceptance_equal", "acceptance_near_tie", "acceptance_mismatch")]
        device = " (CPU)" if row.get("device") == "cpu" else ""
        table.add_row(str(row["host"]) + device, str(row["method"]),
                      "-" if row.get("budget") is None else str(row["budget"]),
                      shown(row.get("acceptance_length")), shown(row.get("offline_acceptance_length")),
                      "/".join("-" if c is None else str(c) for c in counts),
                      shown(row.get("decode_bench_tau")), shown(row.get("baseline_tau")), _mark(row.get("verdict")))
    console.print(table)
    console.print(f"  {SERVER_NOTE}", soft_wrap=True)
    for note in comparison.notes:
        console.print(styled("note", "yellow"), inert(note, one_line=True))


def report(
    run_id: Annotated[Optional[str], typer.Argument(help="Run to report (default: the latest).",
                                                    show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    baseline: Annotated[Optional[Path], typer.Option(
        "--baseline", help="Compare with this file (exit 5 on a regression, 6 if a value was too noisy to judge): a metrics baseline "
        "(`metrics:` list) or a decode baseline from `ddtree-ops baseline import|paper`.",
        show_default=False)] = None,
    tau_tolerance: Annotated[Optional[float], typer.Option(
        "--tau-tolerance", min=0.0, help="Decode baselines: allowed |tau - baseline tau| "
        f"(default {DEFAULT_TAU_TOLERANCE:g}).", show_default=False)] = None,
    baseline_dataset: Annotated[Optional[str], typer.Option(
        "--baseline-dataset", help="Decode baselines: compare the run's prompt set with this baseline "
        "dataset (e.g. math500).", show_default=False)] = None,
    baseline_model: Annotated[Optional[str], typer.Option(
        "--baseline-model", help="Decode baselines: compare the run's model with this baseline model "
        "(e.g. Qwen3-8B).", show_default=False)] = None,
    acceptance_tolerance: Annotated[Optional[float], typer.Option(
        "--acceptance-tolerance", min=0.0, help="sglang-e2e: how far (tokens per round) the server's acceptance "
        "length may fall below the offline loop's, decode-bench's tau and a decode --baseline's before it is "
        f"a regression (default {DEFAULT_ACCEPTANCE_TOLERANCE:g}).", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write PNG charts into DIR: tree-build time vs budget per host; tau and "
        "speedup vs budget (with a decode --baseline overlaid); the server's acceptance and tokens/s vs "
        "budget beside the paper's curve.", show_default=False)] = None,
    runs_dir: RunsDirOpt = None,
) -> int:
    """Render a smoke run: status per host and stage, failures, the sweeps; compare with a baseline."""
    from ddtree_ops.cli.console import emit_json, say, stdout_console
    from ddtree_ops.errors import ExitCode, UsageError
    from ddtree_ops.report.decode_checks import compare_decode, decode_baseline_overlay
    from ddtree_ops.report.metric_checks import BaselineKind, compare_metrics, load_any_baseline
    from ddtree_ops.report.model import build_report
    from ddtree_ops.report.plots import plot_run
    from ddtree_ops.report.server_checks import compare_server
    from ddtree_ops.recommend import predicted_vs_measured, run_recommendations
    from ddtree_ops.results import RunStore, check_run_id, runs_root

    if run_id is not None:
        check_run_id(run_id)  # a path part: refused before anything is read
    if plot is not None:
        from ddtree_ops.local_dirs import ensure_output_dir

        ensure_output_dir(plot, "--plot")
    kind, loaded = load_any_baseline(baseline) if baseline is not None else (None, None)
    decode_options = {"--tau-tolerance": tau_tolerance, "--baseline-dataset": baseline_dataset,
                      "--baseline-model": baseline_model}
    given = [name for name, value in decode_options.items() if value is not None]
    if given and kind is not BaselineKind.DECODE:
        what = f"{baseline} is a metrics baseline (tolerances are per metric there)" if baseline \
            else "no --baseline given"
        raise UsageError(f"{', '.join(given)} applies to a decode baseline; {what}")
    run = RunStore(runs_root(runs_dir)).load(run_id)
    model = build_report(run)
    recommendations, predictions = run_recommendations(run), predicted_vs_measured(run)
    comparisons: list[Any] = []
    decode = None
    if kind is BaselineKind.METRICS:
        comparisons = compare_metrics(run, loaded)
    elif kind is BaselineKind.DECODE:
        decode = compare_decode(model, loaded, DEFAULT_TAU_TOLERANCE if tau_tolerance is None else tau_tolerance,
                                dataset=baseline_dataset, model=baseline_model)
        comparisons = list(decode.checks)
    server = compare_server(model, DEFAULT_ACCEPTANCE_TOLERANCE if acceptance_tolerance is None else acceptance_tolerance,
                            loaded if kind is BaselineKind.DECODE else None, baseline_dataset, baseline_model)
    comparisons += server.checks
    regressions = [c for c in comparisons if not c.ok and getattr(c, "checked", True)]
    noisy = [c for c in comparisons if getattr(c, "noisy", False)]
    unchecked = [c for c in comparisons if not getattr(c, "checked", True) and c not in noisy]
    plots: list[str] = []
    if plot is not None:
        overlay = decode_baseline_overlay(model, loaded, baseline_dataset, baseline_model) \
            if kind is BaselineKind.DECODE and model.decode else None
        plots = [str(p) for p in plot_run(model, plot, decode_baseline=overlay)]
    # a regression: 5; else a timed value too noisy to judge: 6 (the verdict is partial); else 0
    code = ExitCode.REMOTE if regressions else ExitCode.PARTIAL if noisy else ExitCode.OK
    if json_out:
        document = {"command": "report", **model.to_dict()}
        document["exit_code"] = int(code)  # this command's (0, or 5 on a regression)
        document["recommendations"] = [r.to_dict() for r in recommendations]
        document["predicted_vs_measured"] = predictions
        if kind is BaselineKind.METRICS:
            document["baseline"] = {"file": str(baseline), "kind": kind.value,
                                    "comparisons": [c.to_dict() for c in comparisons],
                                    "regressions": len(regressions), "not_checked": len(unchecked),
                                    "not_judged_noisy": len(noisy)}
        elif decode is not None:
            document["baseline"] = {"file": str(baseline), "kind": BaselineKind.DECODE.value,
                                    "baseline_dataset": baseline_dataset, "baseline_model": baseline_model,
                                    **decode.to_dict()}
        document["server_vs_offline"] = server.to_dict()
        if plot is not None:
            document["plots"] = plots
        emit_json(document)
    else:
        console = stdout_console()
        render_report(model, console)
        render_recommendations(recommendations, predictions, console)
        if kind is BaselineKind.METRICS:
            render_comparisons(comparisons, console)
        elif decode is not None:
            render_decode_comparison(decode, console)
        render_server_comparison(server, console)
        for path in plots:
            say(f"wrote {path}")
        if plot is not None and not plots:
            say("no tree-bench, decode-bench or sglang-e2e results in this run: nothing to plot")
    for item in regressions:  # a tau far above the baseline is no loss: said as it is (still exit 5)
        say(f"{getattr(item, 'verdict', 'regression')}: {item.line()}")
    if noisy:
        say(f"{len(noisy)} baseline check(s) not judged: the measured value is noisy (exit 6 unless "
            "a regression was found; rerun on a quiet host, or with more --repeat)")
    if unchecked:
        hosts = sorted({item.host for item in unchecked})
        say(f"{len(unchecked)} baseline check(s) not made: host(s) {', '.join(hosts)} not in this run")
    return int(code)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
