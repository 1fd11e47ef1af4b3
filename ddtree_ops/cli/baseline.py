"""`ddtree-ops baseline import RUN.pt ... [-o FILE]` and `baseline paper [-o FILE]`.

`import` reads the reference's saved run files with a restricted unpickler (only the types
those files hold; anything else is refused before it can run) and writes one small JSON
baseline; `paper` writes the paper's published numbers (shipped in `baselines/`) in the same
format. Either file feeds `ddtree-ops report --baseline FILE`. Nothing is written unless every
input was read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, List, Optional

import typer

baseline_app = typer.Typer(help="Turn offline reference runs or the paper's numbers into a baseline file.",
                           no_args_is_help=True)

OutputOpt = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", help="Write the JSON baseline here (default: print it).", show_default=False),
]


def _emit(baseline, output: Optional[Path]) -> None:  # noqa: ANN001 - Baseline, imported lazily
    from ddtree_ops.cli.console import say
    from ddtree_ops.local_dirs import write_output_file

    text = baseline.to_json()
    if output is None:
        typer.echo(text, nl=False)
        return
    write_output_file(output, text, "the baseline")
    say(f"wrote {len(baseline.entries)} baseline entries to {output}")


def _print_table(baseline) -> None:  # noqa: ANN001
    from rich.table import Table

    from ddtree_ops.cli.console import stderr_console

    table = Table(title="baseline", title_justify="left")
    for column in ("dataset", "model", "T", "method", "tau", "speedup", "ms/token", "same as AR"):
        table.add_column(column)
    for e in baseline.entries:
        table.add_row(
            e.dataset, e.model, f"{e.temperature:g}", e.method, f"{e.tau:.2f}",
            "-" if e.speedup is None else f"{e.speedup:.2f}x",
            "-" if e.time_per_output_token is None else f"{e.time_per_output_token * 1e3:.2f}",
            "-" if e.identical_to_ar is None else f"{e.identical_to_ar:.0%}",
        )
    stderr_console().print(table)


@baseline_app.command("import")
def import_runs(
    runs: Annotated[List[Path], typer.Argument(help="Run files saved by the reference's benchmark.py.")],
    output: OutputOpt = None,
) -> int:
    """Summarise reference run files: tau, histogram, time per token, speedup per method."""
    already = _already_baselines(runs)
    if already:
        return _use_as_is(runs, already, output)
    from ddtree_ops.report.baselines import import_reference_runs

    baseline = import_reference_runs(runs)
    if output is not None:
        _print_table(baseline)
    _emit(baseline, output)
    return 0


def _already_baselines(runs: List[Path]) -> list[tuple[Path, str]]:
    """The inputs that are baseline files already (JSON that `report --baseline` reads, such
    as the paper's numbers in baselines/), with their text, told by a cheap look before torch is
    imported. Only regular files are looked at (a FIFO or /dev/zero is left to the importer,
    which refuses it)."""
    from ddtree.bounded_files import FileRefused, open_regular

    from ddtree_ops.errors import ConfigError
    from ddtree_ops.report.metric_checks import BaselineKind, baseline_kind, read_baseline_document

    found = []
    for path in runs:
        try:
            with open_regular(path, max_bytes=None) as handle:
                head = handle.read(1)
        except (OSError, FileRefused):
            continue  # the importer names it
        if head in (b"{", b"[") or path.suffix in (".json", ".yaml", ".yml"):
            try:
                document = read_baseline_document(path)
            except ConfigError:
                continue  # not a baseline either: the importer says what it is
            if baseline_kind(document) is BaselineKind.DECODE:
                found.append((path, json.dumps(document, indent=1, sort_keys=True) + "\n"))
    return found


def _use_as_is(runs: List[Path], already: list[tuple[Path, str]], output: Optional[Path]) -> int:
    """A baseline given to `import`: said so at once; alone, it is passed through (as the JSON
    that was read: what is copied is what was checked)."""
    from ddtree_ops.cli.console import say
    from ddtree_ops.errors import UsageError

    names = ", ".join(str(p) for p, _ in already)
    if len(runs) > 1:
        raise UsageError(f"{names}: already a baseline, not a reference run file: give it to "
                         f"`ddtree-ops report --baseline`, and the .pt run files alone to `baseline import`")
    say(f"{names} is already a baseline (nothing to import): use it as is, "
        f"`ddtree-ops report --baseline {names}`")
    text = already[0][1]
    if output is not None:
        from ddtree_ops.local_dirs import write_output_file

        write_output_file(output, text, "the baseline")
        say(f"copied it to {output}")
    else:
        typer.echo(text, nl=False)
    return 0


@baseline_app.command("paper")
def paper(output: OutputOpt = None) -> int:
    """The paper's Table 1, MATH-500 budget sweep and histogram as a baseline file."""
    from ddtree_ops.report.baselines import paper_baseline

    _emit(paper_baseline(), output)
    return 0


def register(app: typer.Typer) -> None:
    app.add_typer(baseline_app, name="baseline")
