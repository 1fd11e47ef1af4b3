"""Baselines: the reference's saved runs (read safely), the paper's numbers, and the comparison.

- `load_reference_run(path)`: the reference's `benchmark.py` saves a dict with `responses`
  (method key -> `types.SimpleNamespace`) through `torch.save`. A full unpickler would run
  any code a file names, so we load with torch's weights-only unpickler and allow exactly one
  extra global, `types.SimpleNamespace`; a file naming any other global is refused, with the
  name, before anything from it runs.
- `import_reference_runs(paths)` -> `Baseline`: per (dataset, model, temperature, method)
  tau, acceptance histogram, time per output token, speedup over AR, token identity with AR.
- `paper_baseline(folder)`: the paper's Table 1, budget sweep and histogram (shipped CSVs).
- `compare_summaries(run, baseline, tau_tolerance)`: the rule `report --baseline` applies
  to a decode baseline (`ddtree_ops.report.decode_checks.compare_decode` turns it into per-host checks).
"""
from __future__ import annotations

import csv
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, Sequence

from ddtree.runsummary import AUTOREGRESSIVE_KEY, MethodSummary, summarize_methods
from ddtree_ops.errors import BaselineFileError, quoted
from ddtree_ops.results import sha256_file

BASELINE_FORMAT = "ddtree-ops-baseline/1"
# The checkout's baselines/ folder; an installed package has them in <prefix>/share/ddtree-ops/
# (pyproject.toml's data-files): `pip install ddtree-ops` then `baseline paper` found nothing.
PAPER_DIR = next((folder for folder in (Path(__file__).resolve().parents[2] / "baselines",
                                        Path(sys.prefix) / "share" / "ddtree-ops" / "baselines")
                  if folder.is_dir()), Path(__file__).resolve().parents[2] / "baselines")
PAPER_SOURCE = "DDTree paper (Ringel & Romano 2026, arXiv 2604.12989)"

# The reference's dataset keys (its `--dataset`) and the paper's display names.
DATASET_KEYS = {
    "MATH-500": "math500", "GSM8K": "gsm8k", "AIME 2024": "aime24", "AIME 2025": "aime25",
    "HumanEval": "humaneval", "MBPP": "mbpp", "LiveCodeBench": "livecodebench",
    "SWE-bench Lite": "swe-bench", "MT-Bench": "mt-bench", "Alpaca": "alpaca",
}
PAPER_METHODS = {"DFlash": "dflash", "DDTree": "ddtree_best"}
REQUIRED_RECORD_FIELDS = ("acceptance_lengths", "time_per_output_token", "output_ids", "num_input_tokens", "stage_times")

# Bounds on a reference run file, checked before anything is inflated, materialised or walked: a
# crafted file can be small on disk (a deflated member, a stride-0 view, one record referenced a
# million times) and huge in memory. Real runs sit far below them (MATH-500 x 8 methods x 16K
# tokens is 64M token ids).
MAX_ARCHIVE_BYTES = 1 << 30  # everything inside the torch.save archive, inflated
MAX_RESPONSES = 100_000  # prompts in one run
MAX_METHODS = 1_000  # methods per response
MAX_FIELD_ITEMS = 4_000_000  # output_ids / acceptance_lengths of one record
MAX_STAGE_TIMES = 10_000  # stage_times entries of one record
MAX_TOTAL_ITEMS = 64_000_000  # the above over all records of the file (each reference counted)


def short_model_name(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]


# --------------------------------------------------------------------------- reference runs


# A reference run file holds at most MAX_ARCHIVE_BYTES inside its archive; the file itself, a
# little more (torch.save stores members uncompressed, plus zip headers).
MAX_REFERENCE_FILE_BYTES = MAX_ARCHIVE_BYTES + (64 << 20)


def open_reference_run(path: Path) -> BinaryIO:
    """The reference run file, opened once (the checks and the load read this very file): a
    regular file of at most MAX_REFERENCE_FILE_BYTES (a FIFO or /dev/zero is refused, never
    read); BaselineFileError naming the file otherwise."""
    from ddtree.bounded_files import FileRefused, open_regular

    try:
        return open_regular(path, MAX_REFERENCE_FILE_BYTES)
    except FileNotFoundError:
        raise BaselineFileError(f"{path}: no such file") from None
    except FileRefused as err:
        if path.is_dir():
            raise BaselineFileError(f"{path}: a folder; give the reference run files in it (e.g. {path}/*.pt)") from None
        raise BaselineFileError(str(err)) from None


def load_reference_run(path: Path) -> dict[str, Any]:
    """Read one reference run file with the restricted unpickler; raise BaselineFileError."""
    with open_reference_run(path) as handle:
        return read_reference_run(handle, path)


def read_reference_run(handle: BinaryIO, path: Path) -> dict[str, Any]:
    """The reference run in the open file `handle` (named `path` in messages)."""
    import pickle
    import types
    import warnings

    import torch

    _check_archive(handle, path)
    try:
        handle.seek(0)
        with torch.serialization.safe_globals([types.SimpleNamespace]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes on odd files: the error below says it all
            data = torch.load(handle, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found:
            raise BaselineFileError(
                f"{path}: refused: the file names the global {found.group(1)!r}, which a reference run "
                "never holds (nothing from the file was run)"
            ) from None
        # torch's own text here is boilerplate about loading unsafely: never our advice
        raise BaselineFileError(f"{path}: not a reference run file we can read safely ({_pickle_kind(handle)}; "
                                "nothing from the file was run)") from None
    except Exception as err:  # noqa: BLE001 - untrusted bytes fail in many ways, all meaning the same
        raise BaselineFileError(f"{path}: not a torch.save file: {type(err).__name__}: {_first_line(err)}") from None
    _check_run_layout(path, data)
    return data


def _check_archive(handle: BinaryIO, path: Path) -> None:
    """Only a torch.save archive is read, and only if its members inflate to at most
    MAX_ARCHIVE_BYTES (torch allocates each member at its declared size; torch.save never
    compresses, so a deflated member is a crafted one). Torch's legacy format is refused: its
    storages declare sizes that cannot be checked before torch allocates them."""
    import zipfile

    try:
        handle.seek(0)
        with zipfile.ZipFile(handle) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        raise BaselineFileError(f"{path}: not a reference run file we can read safely ({_pickle_kind(handle)}; "
                                "nothing from the file was run)") from None
    total = 0
    for member in members:
        total += member.file_size
        if total > MAX_ARCHIVE_BYTES:
            raise BaselineFileError(
                f"{path}: archive member {quoted(member.filename)}: the archive inflates past the limit of "
                f"{MAX_ARCHIVE_BYTES} bytes ({member.file_size} bytes in this member); refused before reading it")


def _pickle_kind(handle: BinaryIO) -> str:
    try:
        handle.seek(0)
        head = handle.read(4)
    except (OSError, ValueError):
        return "unreadable"
    if head.startswith(b"PK\x03\x04"):
        return "a torch.save archive holding what the restricted loader does not accept"
    if head.startswith(b"\x80"):
        return "a raw pickle, not torch.save's archive"
    return "neither torch.save's archive nor a pickle"


def _sha256_of(handle: BinaryIO) -> str:
    import hashlib

    digest = hashlib.sha256()
    handle.seek(0)
    for chunk in iter(lambda: handle.read(1 << 16), b""):
        digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def _check_run_layout(path: Path, data: Any) -> None:
    if not isinstance(data, dict):
        raise BaselineFileError(f"{path}: not a reference run: expected a dict, got {type(data).__name__}")
    for key in ("responses", "args"):
        if key not in data:
            raise BaselineFileError(f"{path}: not a reference run: missing key {key!r}")
    args, responses = data["args"], data["responses"]
    if not isinstance(args, dict):
        raise BaselineFileError(f"{path}: not a reference run: 'args' is a {type(args).__name__}, expected a dict")
    for key in ("dataset", "model_name_or_path", "temperature"):
        if key not in args:
            raise BaselineFileError(f"{path}: not a reference run: args has no {key!r}")
    if not isinstance(responses, list) or not responses:
        raise BaselineFileError(f"{path}: not a reference run: 'responses' must be a non-empty list")
    if len(responses) > MAX_RESPONSES:
        raise BaselineFileError(f"{path}: responses: {len(responses)} responses, past the limit of {MAX_RESPONSES}")
    _check_args(path, args)
    methods = None
    budget = _ItemBudget(path)
    for index, response in enumerate(responses):
        if not isinstance(response, dict) or not response:
            raise BaselineFileError(f"{path}: responses[{index}]: expected a dict of method -> record")
        if len(response) > MAX_METHODS:
            raise BaselineFileError(f"{path}: responses[{index}]: {len(response)} methods, past the limit of {MAX_METHODS}")
        if methods is None:
            methods = set(response)
        elif set(response) != methods:
            raise BaselineFileError(f"{path}: responses[{index}]: methods {quoted(list(response))} differ from "
                                    f"responses[0]'s {quoted(list(methods))}")
        for method, record in response.items():
            where = f"{path}: responses[{index}][{quoted(method)}]"
            missing = [name for name in REQUIRED_RECORD_FIELDS if not hasattr(record, name)]
            if missing:
                raise BaselineFileError(f"{where}: missing {', '.join(missing)}")
            _check_record(where, record, budget)


class _ItemBudget:
    """Counts the items the summaries will walk, over every record as often as it is referenced."""

    def __init__(self, path: Path):
        self.path, self.used = path, 0

    def take(self, where: str, field_name: str, count: int, limit: int = MAX_FIELD_ITEMS) -> None:
        if count > limit:
            raise BaselineFileError(f"{where}.{field_name}: {count} items, past the limit of {limit}")
        self.used += count
        if self.used > MAX_TOTAL_ITEMS:
            raise BaselineFileError(f"{self.path}: {where.split(': ', 1)[-1]}.{field_name}: the file's records hold "
                                    f"more than the limit of {MAX_TOTAL_ITEMS} items in all")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_args(path: Path, args: Mapping[str, Any]) -> None:
    for key in ("dataset", "model_name_or_path"):
        if not isinstance(args[key], str) or not args[key]:
            raise BaselineFileError(f"{path}: args.{key}: expected a name, got {quoted(args[key])}")
    temperature = args["temperature"]
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise BaselineFileError(f"{path}: args.temperature: expected a finite number >= 0, got {quoted(temperature)}")


def _check_record(where: str, record: Any, budget: _ItemBudget) -> None:
    """One method's record of one request, in the shapes the summary reads (the reference's
    benchmark.py writes them so); BaselineFileError naming the field otherwise, so that no
    odd value reaches the arithmetic (a NaN would end up in the baseline file). Sizes are
    checked before any field is walked or materialised."""
    import torch

    lengths = record.acceptance_lengths  # list[int], as both the reference and DecodeResult hold them
    if not isinstance(lengths, (list, tuple)):
        raise BaselineFileError(f"{where}.acceptance_lengths: expected a list of whole numbers >= 1, "
                                f"got {quoted(lengths)}")
    budget.take(where, "acceptance_lengths", len(lengths))
    for length in lengths:  # a round accepts at least the root
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise BaselineFileError(f"{where}.acceptance_lengths: expected whole numbers >= 1, got {quoted(length)}")
    tpot = record.time_per_output_token
    if not _is_real(tpot) or not math.isfinite(tpot) or tpot < 0:
        raise BaselineFileError(f"{where}.time_per_output_token: expected a finite number >= 0, got {quoted(tpot)}")
    ids = record.output_ids  # [1, n] int64 (or [n])
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool or \
            not (ids.dim() == 1 or (ids.dim() == 2 and ids.shape[0] == 1)):
        got = f"a {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else quoted(ids)
        raise BaselineFileError(f"{where}.output_ids: expected a [1, n] integer tensor, got {got}")
    budget.take(where, "output_ids", ids.numel())  # a stride-0 view is small on disk, not here
    prompt = record.num_input_tokens
    if isinstance(prompt, bool) or not isinstance(prompt, int) or not 0 <= prompt <= ids.shape[-1]:
        raise BaselineFileError(f"{where}.num_input_tokens: expected a whole number from 0 to the "
                                f"{ids.shape[-1]} output_ids, got {quoted(prompt)}")
    stage_times = record.stage_times
    if isinstance(stage_times, Mapping):
        budget.take(where, "stage_times", len(stage_times), MAX_STAGE_TIMES)
    if not isinstance(stage_times, Mapping) or not all(
            isinstance(k, str) and _is_real(v) and math.isfinite(v) and v >= 0 for k, v in stage_times.items()):
        raise BaselineFileError(f"{where}.stage_times: expected an object of stage -> finite seconds >= 0, "
                                f"got {quoted(stage_times)}")


def summarize_reference_run(path: Path, data: Mapping[str, Any]) -> list[MethodSummary]:
    """Per-method summaries of a run `load_reference_run` accepted; BaselineFileError naming
    the file, method and field for a value a baseline cannot hold (e.g. an infinite speedup)."""
    args = data["args"]
    methods = list(data["responses"][0])
    records = {m: [response[m] for response in data["responses"]] for m in methods}
    summaries = summarize_methods(
        records, dataset=str(args["dataset"]), model=short_model_name(args["model_name_or_path"]),
        temperature=float(args["temperature"]), source=path.name,
    )
    for summary in summaries:
        try:
            summary.check()
        except ValueError as err:
            raise BaselineFileError(f"{path}: {summary.method}: {err}") from None
    return summaries


# --------------------------------------------------------------------------- the baseline file


@dataclass
class Baseline:
    entries: list[MethodSummary]
    sources: list[dict[str, str]] = field(default_factory=list)  # {"file": name, "sha256": hex} or {"source": text}

    def index(self) -> dict[tuple[str, str, float, str], MethodSummary]:
        return {entry.key: entry for entry in self.entries}

    def to_dict(self) -> dict[str, Any]:
        return {"format": BASELINE_FORMAT, "sources": self.sources, "entries": [e.to_dict() for e in self.entries]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n"  # strict JSON: no NaN

    @classmethod
    def from_json(cls, text: str, where: str) -> "Baseline":
        from ddtree.bounded_files import FileRefused, parse_json

        try:
            body = parse_json(text, where)
        except FileRefused as err:
            raise BaselineFileError(str(err)) from None
        return cls.from_dict(body, where)

    @classmethod
    def from_dict(cls, body: Any, where: str) -> "Baseline":
        """The parsed JSON document; every error names `where` and the entry."""
        if not isinstance(body, dict) or body.get("format") != BASELINE_FORMAT:
            got = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise BaselineFileError(f"{where}: not a ddtree-ops baseline (format {quoted(got)}, expected {BASELINE_FORMAT!r})")
        raw_entries = body.get("entries", [])
        if not isinstance(raw_entries, list):
            raise BaselineFileError(f"{where}: entries: expected a list, got {type(raw_entries).__name__}")
        entries = []
        for index, raw in enumerate(raw_entries):
            try:
                entries.append(MethodSummary.from_dict(raw))
            except (TypeError, ValueError, AttributeError) as err:
                raise BaselineFileError(f"{where}: entries[{index}]: {err}") from None
        sources = body.get("sources", [])
        if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
            raise BaselineFileError(f"{where}: sources: expected a list of objects, got {quoted(sources)}")
        return cls(entries=entries, sources=sources)


def read_baseline(path: Path) -> Baseline:
    """A decode baseline file, read by the bounded reader (regular file, size, UTF-8, depth)."""
    from ddtree.bounded_files import FileRefused, read_text

    try:
        text = read_text(path)
    except FileNotFoundError:
        raise BaselineFileError(f"{path}: no such file") from None
    except FileRefused as err:
        raise BaselineFileError(str(err)) from None
    return Baseline.from_json(text, str(path))


def import_reference_runs(paths: Sequence[Path]) -> Baseline:
    """Read every file first (all or nothing), then summarise; duplicate cells are an error."""
    entries: list[MethodSummary] = []
    seen: dict[tuple, str] = {}
    sources = []
    for path in paths:
        with open_reference_run(path) as handle:  # the bytes hashed are the bytes read
            data = read_reference_run(handle, path)
            digest = _sha256_of(handle)
        for entry in summarize_reference_run(path, data):
            if entry.key in seen:
                raise BaselineFileError(f"{path}: {entry.key} already comes from {seen[entry.key]}")
            seen[entry.key] = path.name
            entries.append(entry)
        sources.append({"file": path.name, "sha256": digest})
    return Baseline(entries=entries, sources=sources)


# --------------------------------------------------------------------------- the paper


# The columns of each of the paper's tables in baselines/ (a header line after `#` comments).
TABLE1_COLUMNS = ("temperature", "dataset", "model", "method", "speedup", "tau")
SWEEP_COLUMNS = ("budget", "speedup", "tau")
HISTOGRAM_COLUMNS = ("acceptance_length", "dflash_percent", "ddtree_b512_percent")
PAPER_BASELINE_HINT = ("use the paper baseline, which joins the three tables (baselines/ddtree-paper.json, "
                       "or `ddtree-ops baseline paper -o FILE`)")


def _read_csv(path: Path) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """(comments, header, rows) of a paper table: `#` lines, then a CSV with a header."""
    from ddtree.bounded_files import FileRefused, read_text

    try:  # the bounded reader: a FIFO or a device given as a table is refused, never read
        lines = read_text(path).splitlines()
    except FileRefused as err:
        raise BaselineFileError(f"{path}: cannot read: {err.why}") from None
    except OSError as err:
        raise BaselineFileError(f"{path}: cannot read: {err.strerror or err}") from None
    comments = [line[1:].strip() for line in lines if line.startswith("#")]
    reader = csv.DictReader(line for line in lines if line and not line.startswith("#"))
    rows = list(reader)
    return comments, list(reader.fieldnames or []), rows


def _cell(path: Path, index: int, row: dict[str, str], column: str, kind: type) -> Any:
    """A row's value as `kind`; BaselineFileError naming the file, the row and the column."""
    try:
        value = kind(row[column])
    except (TypeError, ValueError):
        raise BaselineFileError(f"{path}: row {index + 1}: {column}: expected {kind.__name__}, "
                                f"got {quoted(row.get(column))}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise BaselineFileError(f"{path}: row {index + 1}: {column}: expected a finite number, got {row[column]!r}")
    return value


def _table1_entries(path: Path, rows: list[dict[str, str]]) -> list[MethodSummary]:
    entries = []
    for index, row in enumerate(rows):
        method = PAPER_METHODS.get(row["method"])
        if method is None:
            raise BaselineFileError(f"{path}: row {index + 1}: method: expected one of {sorted(PAPER_METHODS)}, "
                                    f"got {quoted(row['method'])}")
        entries.append(MethodSummary(
            dataset=DATASET_KEYS.get(row["dataset"], row["dataset"]), model=row["model"],
            temperature=_cell(path, index, row, "temperature", float), method=method, budget=None,
            tau=_cell(path, index, row, "tau", float), speedup=_cell(path, index, row, "speedup", float),
            time_per_output_token=None, histogram={}, requests=None, identical_to_ar=None,
            source=PAPER_SOURCE + ", Table 1",
        ))
    return entries


def _sweep_entries(path: Path, rows: list[dict[str, str]],
                   histograms: Mapping[str, dict[int, float]]) -> list[MethodSummary]:
    """The budget trade-off figure: MATH-500, Qwen3-8B, T=0 (its header comment says so)."""
    entries = []
    for index, row in enumerate(rows):
        budget = _cell(path, index, row, "budget", int)
        method = f"ddtree_tb{budget}"
        entries.append(MethodSummary(
            dataset="math500", model="Qwen3-8B", temperature=0.0, method=method, budget=budget, tau=_cell(path, index, row, "tau", float),
            speedup=_cell(path, index, row, "speedup", float), time_per_output_token=None,
            histogram=histograms.get(method, {}), requests=None, identical_to_ar=None,
            source=PAPER_SOURCE + ", budget trade-off figure",
        ))
    return entries


def _histogram(path: Path, rows: list[dict[str, str]], column: str) -> dict[int, float]:
    return {_cell(path, i, r, "acceptance_length", int): _cell(path, i, r, column, float) / 100
            for i, r in enumerate(rows)}


def paper_baseline(folder: Path = PAPER_DIR) -> Baseline:
    """Table 1, the MATH-500 budget sweep and the Qwen3-8B histogram, as baseline entries."""
    sources = []
    tables = {}
    for name in ("ddtree-paper-table1.csv", "ddtree-paper-budget-sweep.csv", "ddtree-paper-acceptance-histogram.csv"):
        comments, _, rows = _read_csv(folder / name)
        sources.append({"file": name, "source": " ".join(comments)})
        tables[name] = rows
    hist_path = folder / "ddtree-paper-acceptance-histogram.csv"
    hist_rows = tables["ddtree-paper-acceptance-histogram.csv"]
    entries = _table1_entries(folder / "ddtree-paper-table1.csv", tables["ddtree-paper-table1.csv"])
    entries += _sweep_entries(folder / "ddtree-paper-budget-sweep.csv", tables["ddtree-paper-budget-sweep.csv"],
                              {"ddtree_tb512": _histogram(hist_path, hist_rows, "ddtree_b512_percent")})
    # The DFlash histogram has no DDTree-style key of its own: attach it to Table 1's cell.
    for entry in entries:
        if entry.key == ("math500", "Qwen3-8B", 0.0, "dflash"):
            entry.histogram = _histogram(hist_path, hist_rows, "dflash_percent")
    return Baseline(entries=entries, sources=sources)


def csv_baseline(path: Path) -> Baseline:
    """One of the paper's tables (baselines/*.csv, or a file of the same columns) as a decode
    baseline of its own cells: Table 1 or the budget sweep. The histogram alone has no tau to
    compare a run with; any other CSV is none of them. Both are refused naming the file."""
    comments, header, rows = _read_csv(path)
    source = [{"file": path.name, "source": " ".join(comments), "sha256": sha256_file(path)}]
    if tuple(header) == TABLE1_COLUMNS:
        return Baseline(entries=_table1_entries(path, rows), sources=source)
    if tuple(header) == SWEEP_COLUMNS:
        return Baseline(entries=_sweep_entries(path, rows, {}), sources=source)
    if tuple(header) == HISTOGRAM_COLUMNS:
        raise BaselineFileError(f"{path}: the paper's acceptance-length histogram alone has no tau or speedup to "
                                f"compare a run with: {PAPER_BASELINE_HINT}")
    raise BaselineFileError(
        f"{path}: a CSV with columns {','.join(header) or '(none)'} is none of the paper's tables (Table 1: "
        f"{','.join(TABLE1_COLUMNS)}; budget sweep: {','.join(SWEEP_COLUMNS)}); other baselines are JSON or YAML")


# --------------------------------------------------------------------------- comparison


@dataclass
class SummaryComparisonRow:
    key: tuple[str, str, float, str]  # (dataset, model, temperature, method) of the run
    tau: float
    baseline_tau: float | None
    speedup: float | None
    baseline_speedup: float | None
    identical_to_ar: float | None
    tau_ok: bool | None  # None: no baseline cell to compare with
    lossless_ok: bool | None  # None: T > 0, not recorded, or `ddtree_best` (its budget's row has it)
    budget: int | None = None  # the run's budget (for `ddtree_best`: the fastest one)
    baseline_key: tuple[str, str, float, str] | None = None  # the cell looked up (after aliases)

    @property
    def ok(self) -> bool:
        return self.tau_ok is not False and self.lossless_ok is not False


@dataclass
class SummaryComparison:
    rows: list[SummaryComparisonRow]
    tau_tolerance: float
    # baseline entries of a (dataset, model, temperature) cell the run measured, for a method
    # the run has no row for (e.g. `dflash`, or a budget the run did not sweep)
    not_compared: list[MethodSummary] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    @property
    def failures(self) -> list[SummaryComparisonRow]:
        return [row for row in self.rows if not row.ok]


def best_ddtree(entries: Iterable[MethodSummary]) -> list[MethodSummary]:
    """Per (dataset, model, temperature): the fastest DDTree budget as method `ddtree_best`
    (how the paper's Table 1 reports DDTree)."""
    best: dict[tuple, MethodSummary] = {}
    for entry in entries:
        if entry.budget is None or entry.speedup is None:
            continue
        cell = entry.key[:3]
        if cell not in best or entry.speedup > (best[cell].speedup or 0.0):
            best[cell] = entry
    return [MethodSummary(**{**entry.__dict__, "method": "ddtree_best"}) for entry in best.values()]


def compare_summaries(
    run: Sequence[MethodSummary],
    baseline: Baseline,
    tau_tolerance: float,
    dataset_alias: Mapping[str, str] | None = None,
    model_alias: Mapping[str, str] | None = None,
) -> SummaryComparison:
    """Compare a run's per-method summaries (decode-bench's `methods` table) with a baseline.

    tau passes when |tau - baseline tau| <= tau_tolerance (absolute); at T=0 every method must
    be token-identical to AR on every request, whatever the baseline holds: a method whose
    `identical_to_ar` was not measured there fails (`lossless_ok` False). `dataset_alias` /
    `model_alias` map a run dataset (e.g. our shipped prompt set) or model name to the baseline
    one it stands in for. Baseline methods of a matched cell that the run lacks are listed in
    `not_compared`.
    """
    if tau_tolerance < 0:
        raise ValueError(f"tau tolerance must be >= 0, got {tau_tolerance}")
    datasets, models = dict(dataset_alias or {}), dict(model_alias or {})
    index = baseline.index()
    rows = []
    labelled = [(entry, False) for entry in run] + [(entry, True) for entry in best_ddtree(run)]
    for entry, derived in labelled:
        dataset, model, temperature, method = entry.key
        looked_up = (datasets.get(dataset, dataset), models.get(model, model), temperature, method)
        cell = index.get(looked_up)
        lossless = None
        if temperature == 0.0 and not derived:  # `ddtree_best`: its budget's own row is checked
            if entry.identical_to_ar is not None:
                lossless = entry.identical_to_ar == 1.0
            elif method != AUTOREGRESSIVE_KEY:  # AR is the reference itself
                lossless = False  # not measured at T=0: never a pass
        rows.append(SummaryComparisonRow(
            key=entry.key, tau=entry.tau, baseline_tau=cell.tau if cell else None,
            speedup=entry.speedup, baseline_speedup=cell.speedup if cell else None,
            identical_to_ar=entry.identical_to_ar,
            tau_ok=None if cell is None else abs(entry.tau - cell.tau) <= tau_tolerance,
            lossless_ok=lossless, budget=entry.budget, baseline_key=looked_up,
        ))
    looked_up_keys = {row.baseline_key for row in rows}
    cells = {key[:3] for key in looked_up_keys if key is not None}
    missing = [e for e in baseline.entries if e.key[:3] in cells and e.key not in looked_up_keys]
    return SummaryComparison(rows=rows, tau_tolerance=tau_tolerance, not_compared=missing)


def summaries_from_rows(rows: Sequence[Mapping[str, Any]], where: str) -> list[MethodSummary]:
    """decode-bench's `methods` table rows (plain JSON) -> summaries."""
    out = []
    for index, row in enumerate(rows):
        try:
            out.append(MethodSummary.from_dict(row))
        except (TypeError, ValueError) as err:
            raise BaselineFileError(f"{where}[{index}]: {err}") from None
    return out


def budget_series(entries: Iterable[MethodSummary]) -> dict[tuple[str, str, float], list[tuple[int, float, float | None]]]:
    """For plots of tau and speedup against budget: per (dataset, model, temperature), the
    DDTree cells as (budget, tau, speedup) sorted by budget (run or baseline alike)."""
    series: dict[tuple[str, str, float], list[tuple[int, float, float | None]]] = {}
    for entry in entries:
        if entry.budget is not None:
            series.setdefault(entry.key[:3], []).append((entry.budget, entry.tau, entry.speedup))
    return {cell: sorted(points) for cell, points in series.items()}
