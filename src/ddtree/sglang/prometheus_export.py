"""DDTree's series in SGLang's Prometheus endpoint (`--enable-metrics`).

SGLang serves `/metrics` in prometheus_client's multi-process mode: the launcher points
PROMETHEUS_MULTIPROC_DIR at a fresh folder before it starts the scheduler processes
(sglang/srt/entrypoints/engine.py:1940-1942 -> srt/utils/common.py:2825-2840), every process
writes its metric values to memory-mapped files there, and the HTTP server's `/metrics`
collects all of them with a MultiProcessCollector (srt/utils/common.py:2843-2853, mounted at
srt/entrypoints/http_server.py:314-315). SGLang's own scheduler series are made the same way,
prometheus_client imported only once that variable is set
(srt/observability/metrics_collector.py:334-349). So the worker, which runs in a scheduler
process, makes its series here, unregistered (registry=None: nothing to collect in-process,
and a worker built twice in one process cannot clash), and they appear in `/metrics` next to
SGLang's.

The values are the plugin's own RoundMetrics snapshots (one per DDTREE_METRICS_INTERVAL
rounds, the same numbers as the `DDTree metrics {json}` log line), so `/metrics` moves in
steps of that interval and costs no device sync of its own.

Names follow Prometheus' conventions: a `ddtree_` prefix, the unit in the name, `_total` on
counters (prometheus_client adds it; the constants here are the exposed family names). Every
series is labelled with SGLang's `model_name` (as its scheduler series are) and the `budget`.
"""
from __future__ import annotations

from typing import Any, Optional

# Family names as /metrics exposes them (a counter's samples add `_total`; a histogram's
# `_bucket`, `_sum`, `_count`). The Grafana dashboard and `ddtree-ops status` read these.
ACCEPTANCE_LENGTH = "ddtree_acceptance_length_tokens"  # histogram per request-round, root included
TREE_TOKENS = "ddtree_tree_tokens"  # counter: tree tokens verified, root included
BRANCHING_TREES = "ddtree_branching_trees"  # counter: request-rounds whose tree is wider than a path
TREE_BUILD_SECONDS = "ddtree_tree_build_seconds"  # histogram per round: tree build + packing
ROUNDS = "ddtree_rounds"  # counter: verify rounds (one per batch)
BUDGET = "ddtree_budget_nodes"  # gauge: draft nodes per tree in force (root excluded)
FAMILIES = (ACCEPTANCE_LENGTH, TREE_TOKENS, BRANCHING_TREES, TREE_BUILD_SECONDS, ROUNDS, BUDGET)
COUNTERS = (TREE_TOKENS, BRANCHING_TREES, ROUNDS)
LABELS = ("model_name", "budget")

# Tree build on a GPU takes 0.1-10 ms a round; the CPU test server is slower.
BUILD_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def observe_counts(histogram: Any, counts: dict[float, int]) -> None:
    """Observe each value `counts[value]` times, in one step per value: prometheus_client has
    no bulk observe, and one call per request-round costs ~3 us in multi-process mode (a
    batch of 256 over 50 rounds: 40 ms of the scheduler's time). Its Histogram keeps a
    non-cumulative count per upper bound (`_upper_bounds`, `_buckets`) and a `_sum`, as
    `observe` itself updates them; a prometheus_client without them is observed one by one."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for value, count in counts.items():
            for _ in range(count):
                histogram.observe(value)
        return
    for value, count in counts.items():
        if count <= 0:
            continue
        total.inc(value * count)
        for index, bound in enumerate(bounds):
            if value <= bound:
                buckets[index].inc(count)
                break


class PrometheusExport:
    """The DDTree series of one server (one budget); `export(snapshot)` adds a snapshot."""

    def __init__(self, model_name: str, budget: int, max_acceptance: int, registry: Any = None):
        # Imported here, never at module level: in a scheduler process this must follow
        # SGLang's PROMETHEUS_MULTIPROC_DIR (prometheus_client picks its value class on import).
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"model_name": str(model_name), "budget": str(int(budget))}
        names = list(LABELS)
        self._acceptance = Histogram(
            ACCEPTANCE_LENGTH, "Accepted tree indices per request-round, root included (tokens committed "
            "per round); comparable with DFlash's acceptance length, unlike sglang:spec_accept_rate",
            names, registry=registry, buckets=[float(n) for n in range(1, max(int(max_acceptance), 1) + 1)],
        ).labels(**labels)
        self._tree_tokens = Counter(TREE_TOKENS, "Tree tokens verified, root included, over all request-rounds",
                                    names, registry=registry).labels(**labels)
        self._branching = Counter(BRANCHING_TREES, "Request-rounds whose tree has more nodes than depth "
                                  "(wider than one path)", names, registry=registry).labels(**labels)
        self._build = Histogram(TREE_BUILD_SECONDS, "Tree build and packing time per verify round", names,
                                registry=registry, buckets=BUILD_SECONDS_BUCKETS).labels(**labels)
        self._rounds = Counter(ROUNDS, "Verify rounds (one per batch)", names, registry=registry).labels(**labels)
        budget_gauge = Gauge(BUDGET, "Draft nodes per tree in force (DDTREE_BUDGET; root excluded)", names,
                             registry=registry, multiprocess_mode="mostrecent").labels(**labels)
        budget_gauge.set(int(budget))

    def export(self, snapshot: Any) -> None:
        """Add one RoundMetrics snapshot (ddtree.sglang.round_metrics.MetricsSnapshot)."""
        counts = {float(length): int(n) for length, n in enumerate(snapshot.acceptance_histogram) if n}
        observe_counts(self._acceptance, counts)
        self._tree_tokens.inc(snapshot.tree_tokens)
        self._branching.inc(snapshot.branching_trees)
        self._rounds.inc(snapshot.rounds)
        for ms in snapshot.build_ms_each:
            self._build.observe(ms / 1e3)

