"""The stage protocol and the wire format of smoke records (host side; stdlib only).

A stage is one module `ddtree_ops/hostside/stages/<name with '-' -> '_'>.py` that defines

    NAME: str                  # the stage name, e.g. "tree-bench"
    DESCRIPTION: str           # one line, shown by the CLI
    def run(ctx: StageContext) -> StageResult

and whose name is listed in `STAGE_ORDER` (the one place the default order lives). The runner
measures the duration; an exception raised by `run` is the stage's failure, traceback kept.

Every event the runner emits is one JSON object per line, on stdout and in
`<workdir>/runs/<run-id>/events.jsonl` on the host. All records carry
`v` (PROTOCOL_VERSION), `event` (an `EventKind` value), `run_id`, `host` and `time`
(Unix seconds); the per-kind fields are listed at `EventKind`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, NamedTuple

PROTOCOL_VERSION = 1

# The default stage order; a stage whose module is missing from a release is left out of the
# default selection (later issues add their stages by adding the file and the name here).
STAGE_ORDER: tuple[str, ...] = (
    "env",
    "import",
    "golden",
    "invariants",
    "tree-bench",
    "lossless",
    "decode-bench",
    "plugin",
    "sglang-e2e",
)


class Status(str, Enum):
    """A stage's outcome. Stages return PASS, FAIL or SKIP; only the runner assigns NOT_RUN;
    only the operator side assigns MISSING (asked for, and no record of it came back)."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    NOT_RUN = "not_run"
    MISSING = "missing"


class EventKind(str, Enum):
    """Event kinds and their fields (besides v, event, run_id, host, time):

    RUN_START   stages [names], options {..}, release_root, expected_release, python,
                pid, keep_going, stage_timeout_s
    STAGE_START stage, index
    LOG         stage, message
    METRIC      stage, name, value
    HEARTBEAT   stage (or null), elapsed_s (in the current stage), last_output (the last line
                the stage or a log in its artifacts folder wrote, or null)
    OUTPUT      stage, file (null: the stage's log; else the name of a *.log in its artifacts
                folder), lines [str]: what it wrote since the last one; only with the runner's
                --stream-output, and never written to events.jsonl (the log files are the record)
    STAGE_END   stage, index, status, reason, duration_s, metrics {..}, tables {name: [rows]},
                traceback (str|null), output_tail (str|null: the stage's last output when it
                crashed or hung), load (timed stages: {before, after} host-load samples, see
                runner.host_load; null otherwise)
    RUN_END     status ("pass" | "fail" | "interrupted" | "error"), counts {status: n},
                duration_s, exit_code
    """

    RUN_START = "run_start"
    STAGE_START = "stage_start"
    LOG = "log"
    METRIC = "metric"
    HEARTBEAT = "heartbeat"
    OUTPUT = "output"
    STAGE_END = "stage_end"
    RUN_END = "run_end"


class RunStatus(str, Enum):
    PASS = "pass"  # every stage passed or skipped
    FAIL = "fail"  # at least one stage failed
    INTERRUPTED = "interrupted"  # stopped by the operator (Ctrl-C / `runner.py stop`)
    ERROR = "error"  # the runner could not start the plan (e.g. an unknown stage name)


# Runner exit codes (mirror ddtree_ops.errors.ExitCode for the ones that apply on a host).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_STAGE_FAILED = 5
EXIT_INTERRUPTED = 130


def stage_module_name(stage: str) -> str:
    """`tree-bench` -> `tree_bench` (the module under ddtree_ops/hostside/stages/)."""
    return stage.replace("-", "_")


def stages_dir() -> Path:
    """The stage modules of this release (or checkout)."""
    return Path(__file__).resolve().parent / "stages"


def stage_names(module_stems: Any) -> list[str]:
    """The stages whose modules have these file stems (`tree_bench`; `_private` ones are none):
    those of STAGE_ORDER first, in that order, then the others (e.g. `lossless-full`) by name."""
    names = {stem.replace("_", "-") for stem in module_stems if not stem.startswith("_")}
    return [s for s in STAGE_ORDER if s in names] + sorted(names - set(STAGE_ORDER))


@dataclass
class SmokeOptions:
    """What the operator chose for this run; stages read what concerns them."""

    budgets: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16])
    seed: int = 0
    repeat: int = 3  # timed calls per benchmark point (median reported)
    extra: dict[str, Any] = field(default_factory=dict)  # stage-specific knobs, JSON values

    def to_dict(self) -> dict[str, Any]:
        return {
            "budgets": list(self.budgets),
            "batch_sizes": list(self.batch_sizes),
            "seed": self.seed,
            "repeat": self.repeat,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SmokeOptions":
        known = {"budgets", "batch_sizes", "seed", "repeat", "extra"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"smoke options: unknown keys {unknown}")
        opts = cls()
        if "budgets" in data:
            opts.budgets = [_non_negative_int("budgets", b) for b in data["budgets"]]
        if "batch_sizes" in data:
            opts.batch_sizes = [_positive_int("batch_sizes", b) for b in data["batch_sizes"]]
        if "seed" in data:
            opts.seed = int(data["seed"])
        if "repeat" in data:
            opts.repeat = _positive_int("repeat", data["repeat"])
        if "extra" in data:
            opts.extra = check_knobs(dict(data["extra"]))
        return opts


class KnobKind(str, Enum):
    """What a `--set` knob's value must be."""

    INT = "an integer"
    FLOAT = "a number"
    BOOL = "true or false"
    STR = "a string"
    INT_LIST = "a list of integers"
    STR_LIST = "a list of strings"


class Knob(NamedTuple):
    kind: KnobKind
    least: float | None = None  # the smallest allowed number (of each item, for a list)


# Every knob a stage may read from options.extra (`--set KEY=VALUE`), its kind and least value:
# the one table. The operator checks `--set` against it before anything is allocated or pushed,
# and the runner again as it reads its plan (a release older or newer than the operator), so an
# unknown knob or a bad value is refused (exit 2) naming the knob, never ignored. A stage that
# reads a new knob declares it here.
KNOBS: dict[str, Knob] = {
    # tree-bench
    "vocab": Knob(KnobKind.INT, 1), "depth": Knob(KnobKind.INT, 1),
    "tree_bench_seconds": Knob(KnobKind.FLOAT, 0.0),
    # decode-bench
    "max_new_tokens": Knob(KnobKind.INT, 1), "temperature": Knob(KnobKind.FLOAT, 0.0),
    "max_prompts": Knob(KnobKind.INT, 1), "strict": Knob(KnobKind.BOOL),
    # lossless
    "lossless_full": Knob(KnobKind.BOOL), "lossless_tokens": Knob(KnobKind.INT, 1),
    "lossless_samples": Knob(KnobKind.INT, 1),
    # sglang-e2e (sglang_concurrency: decode-bench too)
    "sglang_budgets": Knob(KnobKind.INT_LIST, 1), "sglang_port": Knob(KnobKind.INT, 1),
    "sglang_max_new_tokens": Knob(KnobKind.INT, 1), "sglang_start_timeout_s": Knob(KnobKind.FLOAT, 1.0),
    "sglang_attention_backend": Knob(KnobKind.STR), "sglang_extra_args": Knob(KnobKind.STR_LIST),
    "near_tie_gap": Knob(KnobKind.FLOAT, 0.0), "sglang_concurrency": Knob(KnobKind.INT_LIST, 1),
    "sglang_requests_per_level": Knob(KnobKind.INT, 1),
    "sglang_offline_check": Knob(KnobKind.BOOL), "offline_near_tie_margin": Knob(KnobKind.FLOAT, 0.0),
    "acceptance_tolerance": Knob(KnobKind.FLOAT, 0.0),
}


def _comma_ints(value: Any) -> Any:
    """`--set sglang_concurrency=1,8,32` arrives as the string "1,8,32", and `...=8` as the
    number 8: the list each spells."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, str):
        return value
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        return value


def unknown_knob_message(name: str) -> str:
    import difflib

    near = difflib.get_close_matches(name, KNOBS, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"--set {name}: unknown knob{hint}; known knobs: {', '.join(sorted(KNOBS))}"


def check_knobs(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with each knob's value in its kind (`"1,8"` -> [1, 8] for a list of integers);
    ValueError naming the first unknown knob or bad value."""
    for name, value in list(extra.items()):
        rule = KNOBS.get(name)
        if rule is None:
            raise ValueError(unknown_knob_message(name))
        if rule.kind is KnobKind.INT_LIST:
            extra[name] = value = _comma_ints(value)
        if not _knob_ok(value, rule):
            bound = f" >= {rule.least:g}" if rule.least is not None else ""
            raise ValueError(f"--set {name}: expected {rule.kind.value}{bound}, got {value!r}")
    return extra


def _knob_ok(value: Any, rule: Knob) -> bool:
    def number(v: Any, integral: bool) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integral and not isinstance(v, int)):
            return False
        return math.isfinite(v) and (rule.least is None or v >= rule.least)

    if rule.kind in (KnobKind.INT, KnobKind.FLOAT):
        return number(value, rule.kind is KnobKind.INT)
    if rule.kind is KnobKind.INT_LIST:
        return isinstance(value, list) and bool(value) and all(number(v, True) for v in value)
    if rule.kind is KnobKind.STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, bool if rule.kind is KnobKind.BOOL else str)


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"smoke options: {name}: expected an integer >= 0, got {value!r}")
    return value


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"smoke options: {name}: expected an integer >= 1, got {value!r}")
    return value


# A timed stage's `timings` table: one row per measured value (a cell), named like the metric it
# backs (`build_ms.public.bs1.b256`), with the fastest, median and slowest of its samples. The
# operator side judges from these and the stage's host load whether the value can be trusted.
TIMINGS_TABLE = "timings"


def timing_row(cell: str, samples: list[float], unit: str, digits: int = 4) -> dict[str, Any]:
    """The `timings` row of one cell: min / median / max of its samples (same unit)."""
    import statistics

    ordered = sorted(samples)
    return {"cell": cell, "unit": unit, "samples": len(ordered),
            "min": round(ordered[0], digits), "median": round(statistics.median(ordered), digits),
            "max": round(ordered[-1], digits)}


@dataclass
class StageResult:
    status: Status
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def passed(cls, reason: str = "", **kw: Any) -> "StageResult":
        return cls(Status.PASS, reason, **kw)

    @classmethod
    def failed(cls, reason: str, **kw: Any) -> "StageResult":
        return cls(Status.FAIL, reason, **kw)

    @classmethod
    def skipped(cls, reason: str, **kw: Any) -> "StageResult":
        return cls(Status.SKIP, reason, **kw)


@dataclass
class StageContext:
    stage: str
    device: str  # "cuda" if torch sees a GPU, else "cpu" ("none" when torch is missing)
    options: SmokeOptions
    host: dict[str, Any]  # the host's inventory entry as plain data (may hold `models`)
    run_dir: Path  # <workdir>/runs/<run-id> on the host
    release_root: Path  # <workdir>/current: the release under test
    expected_release: str | None  # release id the operator pushed (None: not checked)
    log: Callable[[str], None]
    emit_metric: Callable[[str, Any], None]

    @property
    def artifacts_dir(self) -> Path:
        """A per-stage folder for files worth keeping (fetched by `ddtree-ops collect`)."""
        path = self.run_dir / "artifacts" / self.stage
        path.mkdir(parents=True, exist_ok=True)
        return path


def jsonable(value: Any, where: str) -> Any:
    """Return `value` as plain JSON data (numbers, str, bool, None, lists, dicts).

    Tensors/numpy scalars with `.item()`/`.tolist()` are converted; non-finite floats become
    strings ("nan", "inf") so every line stays strict JSON. Anything else is a TypeError naming
    `where` (e.g. `metric tree-bench.build_ms`).
    """
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Enum):
        return jsonable(value.value, where)
    if hasattr(value, "tolist"):
        return jsonable(value.tolist(), where)
    if hasattr(value, "item"):
        return jsonable(value.item(), where)
    raise TypeError(f"{where}: not JSON-serialisable: {type(value).__name__} {value!r:.80}")


def make_event(kind: EventKind, run_id: str, host: str, **fields: Any) -> dict[str, Any]:
    record = {"v": PROTOCOL_VERSION, "event": kind.value, "run_id": run_id, "host": host,
              "time": round(time.time(), 6)}
    record.update(fields)
    return record


def encode_event(record: dict[str, Any]) -> str:
    """One line of strict JSON (no NaN), without the newline."""
    return json.dumps(jsonable(record, f"event {record.get('event')}"), allow_nan=False,
                      separators=(",", ":"))


def decode_event(line: str) -> dict[str, Any] | None:
    """Parse one line; None for lines that are not a smoke record (e.g. stray output)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or "event" not in record or "v" not in record:
        return None
    return record
