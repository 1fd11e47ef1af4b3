"""PNG charts of a run: tree-build time vs budget (tree-bench) and, with decode-bench results,
acceptance length and speedup vs budget, a decode baseline overlaid. matplotlib is imported
only when a chart is drawn."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ddtree_ops.report.model import Report, as_number


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        from ddtree_ops.errors import UsageError

        raise UsageError("--plot needs matplotlib (pip install matplotlib, or the project's "
                         "`test` extra)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(report: Report, out_dir: Path,
             decode_baseline: list[dict[str, Any]] | None = None) -> list[Path]:
    """Every chart the run has data for: tree-build time vs budget (tree-bench) and, with
    decode-bench results, acceptance length and speedup vs budget; with sglang-e2e results,
    the server's acceptance and tokens/s vs budget beside the paper's curve."""
    return plot_sweep(report, out_dir) + plot_decode(report, out_dir, decode_baseline) + plot_server(report, out_dir)


def paper_budget_curve() -> list[dict[str, Any]]:
    """The paper's DDTree budget sweep and its DFlash level (baselines/), as overlay rows."""
    from ddtree_ops.report.baselines import PAPER_SOURCE, budget_series, paper_baseline

    paper = paper_baseline()
    label = f"paper: MATH-500 · Qwen3-8B · GPU ({PAPER_SOURCE.split(',')[0]})"
    rows = [{"budget": b, "tau": t, "label": f"{label} · DDTree"}
            for cell, points in budget_series(paper.entries).items() for b, t, _ in points]
    flat = paper.index().get(("math500", "Qwen3-8B", 0.0, "dflash"))
    if flat is not None:
        rows.append({"budget": None, "method": "dflash", "tau": flat.tau, "label": f"{label} · DFlash"})
    return rows


def plot_server(report: Report, out_dir: Path) -> list[Path]:
    """sglang-e2e against the budget: acceptance length per host (the server, and the offline
    loop on the same prompts as hollow squares; DFlash as a level) beside the paper's curve (a far
    larger model: read its shape, not its level), and tokens/s per concurrency level. CPU hosts
    are labelled CPU."""
    rows = [r for r in report.server if as_number(r.get("budget")) is not None
            and as_number(r.get("acceptance_length")) is not None]
    if not rows:
        return []
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    hosts = sorted({r["host"] for r in rows})

    def named(host: str) -> str:
        cpu = any(r.get("device") == "cpu" for r in report.server if r["host"] == host)
        return f"{host} (CPU)" if cpu else host

    accept = axes[0]
    for number, host in enumerate(hosts):
        mine = sorted((r for r in rows if r["host"] == host), key=lambda r: r["budget"])
        _plot_series(accept, [(r["budget"], r["acceptance_length"], None, None, False) for r in mine],
                     f"{named(host)} · server DDTree", series_style(0, number))
        offline = [(r["budget"], r["offline_acceptance_length"], None, None, False) for r in mine
                   if as_number(r.get("offline_acceptance_length")) is not None]
        if offline:
            accept.plot([p[0] for p in offline], [p[1] for p in offline], linestyle="none", marker="s",
                        markerfacecolor="none", color=series_style(2, number)["color"],
                        label=f"{named(host)} · offline loop on the server's text")
        for flat in report.server:
            if flat["host"] == host and flat.get("method") == "dflash" and as_number(flat.get("acceptance_length")):
                accept.axhline(flat["acceptance_length"], alpha=0.6, label=f"{named(host)} · server DFlash",
                               **series_style(1, number))
    _overlay_baseline(accept, paper_budget_curve(), "tau")
    accept.set_ylabel("acceptance length (tokens per verify round)")
    speed = axes[1]
    levels = sorted({r["concurrency"] for r in report.server_load if as_number(r.get("concurrency"))})
    for number, host in enumerate(hosts):
        for series, level in enumerate(levels):
            mine = sorted(((r["budget"], r["tokens_per_s"], None, None, False) for r in report.server_load
                           if r["host"] == host and r.get("concurrency") == level and r.get("mode") == "ddtree"
                           and as_number(r.get("tokens_per_s")) is not None), key=lambda p: p[0])
            if mine:
                _plot_series(speed, mine, f"{named(host)} · DDTree · {level} concurrent",
                             series_style(series, number))
            for flat in report.server_load:
                if flat["host"] == host and flat.get("concurrency") == level and flat.get("mode") in ("dflash", "no-spec") \
                        and as_number(flat.get("tokens_per_s")):
                    dashes = ":" if flat["mode"] == "no-spec" else "--"
                    speed.axhline(flat["tokens_per_s"], linestyle=dashes, alpha=0.5,
                                  color=series_style(series, number)["color"],
                                  label=f"{named(host)} · {flat['mode']} · {level} concurrent")
    speed.set_ylabel("output tokens/s (server)")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tree budget (draft nodes)")
        axis.grid(True, which="both", alpha=0.3)
        handles, labels = axis.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        axis.legend(unique.values(), unique.keys(), fontsize=6)
    cpu = any(r.get("device") == "cpu" for r in report.server)
    fig.suptitle(f"DDTree in the SGLang server vs budget · run {report.run_id}"
                 + (" · CPU numbers (SGLang's CPU engine, tiny models), not GPU speed" if cpu else ""))
    fig.tight_layout()
    path = out_dir / "server-vs-budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plot_decode(report: Report, out_dir: Path,
                baseline: list[dict[str, Any]] | None = None) -> list[Path]:
    """tau and speedup against the DDTree budget, a line per host (DFlash as a dashed level);
    `baseline` rows (`budget`, `tau`, `speedup`, optional `label`) are overlaid."""
    rows = [r for r in report.decode if _finite(r.get("budget")) is not None]
    if not rows:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for axis, key, label in ((axes[0], "tau", "acceptance length tau"),
                             (axes[1], "speedup", "speedup over autoregressive")):
        hosts = sorted({r["host"] for r in rows})
        for number, host in enumerate(hosts):
            points = sorted(((_finite(r["budget"]), _finite(r.get(key)), None, None,
                              bool(r.get("noisy")) and key == "speedup")
                             for r in rows if r["host"] == host and _finite(r.get(key)) is not None),
                            key=lambda p: p[:2])
            if points:
                _plot_series(axis, points, f"{host} · DDTree", series_style(0, number))
            for flat in report.decode:
                if flat["host"] == host and flat.get("method") == "dflash" and \
                        _finite(flat.get(key)) is not None:
                    axis.axhline(_finite(flat[key]), alpha=0.6, label=f"{host} · DFlash",
                                 **series_style(1, number))  # DFlash's colour, the host's line style
        _overlay_baseline(axis, baseline or [], key)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tree budget (draft nodes)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        handles, labels = axis.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        axis.legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle(f"DDTree decode vs budget · run {report.run_id}")
    fig.tight_layout()
    return [_save(plt, fig, out_dir, "decode-vs-budget.png")]


def plot_sweep(report: Report, out_dir: Path) -> list[Path]:
    """One PNG per batch size: per-request tree-build time against budget, a line per host
    and builder (log-log, like the paper's budget trade-off figure)."""
    if not report.sweep:
        return []
    plt = _pyplot()
    written = []
    for batch_size in sorted({r.get("batch_size") for r in report.sweep}):
        rows = [r for r in report.sweep if r.get("batch_size") == batch_size]
        fig, axis = plt.subplots(figsize=(7, 4.5))
        hosts = sorted({r["host"] for r in report.sweep})
        builders = sorted({r["builder"] for r in report.sweep})
        for host in hosts:
            for builder in builders:
                points = sorted(((_finite(r.get("budget")), _finite(r.get("per_request_ms")), _finite(r.get("min_ms")),
                                  _finite(r.get("max_ms")), bool(r.get("noisy"))) for r in rows
                                 if r["host"] == host and r["builder"] == builder
                                 and _finite(r.get("budget")) is not None
                                 and _finite(r.get("per_request_ms")) is not None), key=lambda p: p[:2])
                if points:
                    _plot_series(axis, points, f"{host} · {builder}", series_style(builders.index(builder),
                                                                                 hosts.index(host)))
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tree budget (draft nodes)")
        axis.set_ylabel("tree build time per request (ms)")
        axis.set_title(f"DDTree tree build vs budget · batch {batch_size} · run {report.run_id}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, title=NOISY_LEGEND, title_fontsize=7)
        fig.tight_layout()
        written.append(_save(plt, fig, out_dir, f"tree-build-vs-budget-bs{batch_size}.png"))
    return written


def _save(plt: Any, fig: Any, out_dir: Path, name: str) -> Path:
    """The chart as `out_dir/name`, written whole and never through a link at that name (a
    link there is replaced: hostside.safe_write.write_file); ConfigError naming the path if the
    folder cannot take it."""
    import io

    from ddtree_ops.errors import ConfigError
    from ddtree_ops.hostside.safe_write import WriteRefused, write_file

    png = io.BytesIO()
    try:
        fig.savefig(png, dpi=120, format="png")
    finally:
        plt.close(fig)
    try:
        return write_file(out_dir, name, png.getvalue())
    except WriteRefused as err:
        raise ConfigError(str(err)) from None


def _finite(value: Any) -> float | None:
    """A row's value as a finite number to draw, else None (a host's record may hold anything)."""
    number = as_number(value)
    return number if number is not None and math.isfinite(number) else None


NOISY_LEGEND = "hollow marker: noisy; band: min-max"
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (5, 5)))


def series_style(series: int, host: int) -> dict[str, Any]:
    """One colour per builder (or method) and one line style per host, so that no two
    series of a chart look alike until the styles run out (20 colours x 8 styles)."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    return {"color": colours[(2 * series) % 20 + (series // 10) % 2],
            "linestyle": LINE_STYLES[host % len(LINE_STYLES)]}


def _plot_series(axis: Any, points: list[tuple], label: str, style: dict[str, Any]) -> None:
    """(x, median, min, max, noisy) points: a line, a min-max band where both were recorded,
    and hollow markers on noisy points."""
    xs = [p[0] for p in points]
    axis.plot(xs, [p[1] for p in points], marker="o", label=label, markersize=4, **style)
    banded = [p for p in points if as_number(p[2]) is not None and as_number(p[3]) is not None]
    if banded:
        axis.fill_between([p[0] for p in banded], [p[2] for p in banded], [p[3] for p in banded],
                          color=style["color"], alpha=0.15, linewidth=0)
    noisy = [p for p in points if p[4]]
    if noisy:
        axis.plot([p[0] for p in noisy], [p[1] for p in noisy], linestyle="none", marker="o", markersize=8,
                  markerfacecolor="white", markeredgecolor=style["color"])


def _overlay_baseline(axis: Any, rows: list[dict[str, Any]], key: str) -> None:
    """Baseline sweep points joined per label (black, dashed, x) and flat DFlash levels (dotted)."""
    by_label: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        value = as_number(row.get(key))
        if value is None:
            continue
        label = str(row.get("label", "baseline"))
        budget = as_number(row.get("budget"))
        if budget is None:
            if row.get("method") == "dflash":
                axis.axhline(value, color="black", linestyle=":", alpha=0.7, label=label)
            continue
        by_label.setdefault(label, []).append((budget, value))
    for label, points in by_label.items():
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], color="black", linestyle="--",
                  marker="x", alpha=0.8, label=label)
