"""Stage `tree-bench`: the budget sweep of the tree builders on the host's device.

For each budget (options.budgets, 16..1024 by default) and batch size (options.batch_sizes,
1 and 16): the reference-exact heap builder and the public builder (batch 1, one request per
call), the batched device builder (one call per batch; on CUDA also replayed as a CUDA graph,
`graphed`), and the floor every builder pays,
`torch.topk(k=budget)` + `torch.logsumexp` over the rows. Logits are drafter-shaped
`[D=15, V]` float32 rows (V = options.extra["vocab"], default 32000). Medians of
options.repeat timed calls after one warm-up, fewer (at least one) where the sweep runs past
its time budget (`tree_bench_seconds`, `Pacer`); CUDA is synchronised around each call.

Metrics: `build_ms.<builder>.bs<B>.b<budget>` (per request, median) and the `sweep` table
(which also keeps the fastest call: on a shared machine it is the steadier figure); the
`timings` table keeps min / median / max of every cell, so the report can tell noise from data.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple

from ddtree_ops.hostside.protocol import TIMINGS_TABLE, StageContext, StageResult, timing_row

NAME = "tree-bench"
DESCRIPTION = "tree-build time vs budget (heap, public, batched, topk floor), batch 1 and 16"
TIMED = True  # the runner samples the host's load around it

DEFAULT_VOCAB = 32000
DEFAULT_DEPTH = 15  # block size 16 drafters


class Timing(NamedTuple):
    median_ms: float
    min_ms: float  # the least disturbed call: steadier than the median on a shared machine
    samples_ms: list[float]  # every timed call, in order


# The sweep's time budget in seconds (`--set tree_bench_seconds=S`; 0: no budget). On a busy
# host a fixed number of calls per point made the stage 6-7x slower than on an idle one; with a
# budget, points past their share of it get one timed call (the idle sweep fits in it whole).
DEFAULT_SECONDS = 1.5


class Pacer:
    """Spreads a time budget over the sweep's points: point i of n times calls until
    `start + seconds * (i + 1) / n` (at least one call, at most `repeat`), so a point that ran
    short leaves its time to the next ones. `seconds` 0: no deadline."""

    def __init__(self, seconds: float, points: int):
        self.start, self.seconds, self.points, self.done = time.perf_counter(), seconds, max(1, points), 0

    def next_deadline(self) -> float | None:
        self.done += 1
        return self.start + self.seconds * self.done / self.points if self.seconds > 0 else None


def _timed(fn: Callable[[], Any], repeat: int, sync: Callable[[], None], deadline: float | None = None) -> Timing:
    """Wall time of `fn` in milliseconds over `repeat` calls (one untimed warm-up first), or
    fewer once `deadline` (a `time.perf_counter()` value) has passed: never fewer than one. A
    point that starts past its deadline skips the warm-up: its one call is all it gets."""
    if deadline is None or time.perf_counter() < deadline:
        fn()
        sync()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - started) * 1e3)
        if deadline is not None and time.perf_counter() >= deadline:
            break
    return Timing(statistics.median(samples), min(samples), samples)


def drafter_like_logits(torch: Any, batch: int, depth: int, vocab: int, seed: int,
                        device: str) -> Any:
    """[batch, depth, vocab] float32: random rows with a few peaked tokens, like a drafter's."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(batch, depth, vocab, generator=generator)  # [bs, D, V] f32
    peaks = torch.randint(0, vocab, (batch, depth, 4), generator=generator)  # [bs, D, 4] i64
    logits.scatter_(2, peaks, torch.tensor([9.0, 7.5, 6.5, 6.0]).expand(batch, depth, 4))
    return logits.to(device)


def run(ctx: StageContext) -> StageResult:
    import torch

    import ddtree
    from ddtree.build import BuildMethod

    batched = getattr(ddtree, "build_ddtree_trees", None)
    graphed = getattr(ddtree, "GraphedTreeBuilder", None)  # older releases lack it
    extra = ctx.options.extra
    vocab = int(extra.get("vocab", DEFAULT_VOCAB))
    depth = int(extra.get("depth", DEFAULT_DEPTH))
    repeat = ctx.options.repeat
    seconds = float(extra.get("tree_bench_seconds", DEFAULT_SECONDS))
    device = ctx.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"device": device, "vocab": vocab, "depth": depth,
                               "repeat": repeat, "time_budget_s": seconds}
    per_batch = [1 + 2 * (batch == 1) + (batched is not None) + (graphed is not None and device == "cuda")
                 for batch in ctx.options.batch_sizes]
    pacer = Pacer(seconds, sum(per_batch) * len(ctx.options.budgets))
    if device == "cuda":
        metrics["gpu"] = torch.cuda.get_device_name(0)

    def record(builder: str, batch: int, budget: int, timing: Timing, nodes: int | None) -> None:
        per_request = timing.median_ms / batch
        rows.append({"builder": builder, "batch_size": batch, "budget": budget,
                     "call_ms": round(timing.median_ms, 4),
                     "per_request_ms": round(per_request, 4),
                     "per_request_min_ms": round(timing.min_ms / batch, 4), "nodes": nodes})
        metrics[f"build_ms.{builder}.bs{batch}.b{budget}"] = round(per_request, 4)
        timings.append(timing_row(f"build_ms.{builder}.bs{batch}.b{budget}",
                                  [ms / batch for ms in timing.samples_ms], "ms"))

    for batch in ctx.options.batch_sizes:
        logits = drafter_like_logits(torch, batch, depth, vocab, ctx.options.seed, device)
        for budget in ctx.options.budgets:
            k = max(1, min(budget, vocab))
            floor_ms = _timed(lambda: (torch.topk(logits, k, dim=-1),
                                       torch.logsumexp(logits, dim=-1)), repeat, sync, pacer.next_deadline())
            nodes = None
            if batch == 1:
                one = logits[0]  # [D, V] f32
                heap_ms = _timed(lambda: ddtree.build_ddtree_tree_from_logits(
                    one, budget, method=BuildMethod.HEAP), repeat, sync, pacer.next_deadline())
                tree = ddtree.build_ddtree_tree_from_logits(one, budget)
                nodes = len(tree.parents) - 1
                record("heap", 1, budget, heap_ms, nodes)
                record("public", 1, budget, _timed(
                    lambda: ddtree.build_ddtree_tree_from_logits(one, budget), repeat, sync, pacer.next_deadline()),
                    nodes)
            if batched is not None:
                record("batched", batch, budget,
                       _timed(lambda: batched(logits, budget), repeat, sync, pacer.next_deadline()), nodes)
            if graphed is not None and device == "cuda":  # off CUDA it would be the batched row again
                builder = graphed(batch, depth, vocab, budget, dtype=logits.dtype, device=device)
                record("graphed", batch, budget, _timed(lambda: builder(logits), repeat, sync, pacer.next_deadline()), nodes)
                del builder  # its graph pool: one budget's at a time
            record("floor", batch, budget, floor_ms, nodes)
            ctx.log(f"bs {batch} budget {budget}: " + ", ".join(
                f"{r['builder']} {r['per_request_ms']:.3f} ms" for r in rows
                if r["batch_size"] == batch and r["budget"] == budget))
    for budget in ctx.options.budgets:
        heap = metrics.get(f"build_ms.heap.bs1.b{budget}")
        public = metrics.get(f"build_ms.public.bs1.b{budget}")
        if heap and public:
            metrics[f"speedup.public_vs_heap.b{budget}"] = round(heap / public, 3)
            spans = {t["cell"]: t for t in timings}
            heap_t, public_t = spans[f"build_ms.heap.bs1.b{budget}"], spans[f"build_ms.public.bs1.b{budget}"]
            if heap_t["min"] > 0 and public_t["min"] > 0:  # the ratio's range from its parts' ranges
                ratio = timing_row(f"speedup.public_vs_heap.b{budget}", [
                    heap_t["min"] / public_t["max"], heap / public, heap_t["max"] / public_t["min"]], "x", 3)
                timings.append({**ratio, "samples": min(heap_t["samples"], public_t["samples"])})
    note = "" if batched is not None else " (no batched builder in this release)"
    largest = max(ctx.options.budgets, default=0)
    summary = metrics.get(f"build_ms.public.bs1.b{largest}")
    headline = f"public builder {summary:.3f} ms at budget {largest}" if summary else "swept"
    return StageResult.passed(f"{headline} on {device}{note}", metrics=metrics,
                              tables={"sweep": rows, TIMINGS_TABLE: timings})
