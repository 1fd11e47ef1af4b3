"""The plugin's Prometheus series (ddtree.sglang.prometheus_export) built from RoundMetrics
snapshots, read back with prometheus_client's own exposition writer and text parser. (The
same series inside a real SGLang server's /metrics: tests/sglang_server/test_metrics_and_status.py.)"""
from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.sglang import prometheus_export as px
from ddtree.sglang.round_metrics import RoundMetrics
from sglang_plugin.host_reads import HostReads


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_round_metrics_keeps_the_acceptance_histogram_and_exact_sums():
    seen = []
    metrics = RoundMetrics(3, "cpu", seen.append, max_acceptance=4)
    metrics.record(torch.tensor([1, 3, 3]), torch.tensor([9, 9, 9]), lambda: 2.0,
                   branching=torch.tensor([False, True, True]))
    metrics.record(torch.tensor([4]), torch.tensor([7]), lambda: 4.0, branching=torch.tensor([True]))
    snapshot = metrics.record(torch.tensor([2, 1]), torch.tensor([5, 5]))  # an untimed round
    assert seen == [snapshot]
    assert snapshot.acceptance_histogram == (0, 2, 1, 2, 1)  # lengths 1, 2, 3, 4
    assert (snapshot.requests, snapshot.rounds, snapshot.tree_tokens, snapshot.branching_trees) == (6, 3, 44, 3)
    assert sum(length * n for length, n in enumerate(snapshot.acceptance_histogram)) == 14
    assert snapshot.mean_acceptance_length == pytest.approx(14 / 6)
    assert (snapshot.timed_rounds, snapshot.build_ms_total, snapshot.build_ms_each) == (2, 6.0, (2.0, 4.0))
    logged = snapshot.to_dict()
    assert "build_ms_each" not in logged and logged["acceptance_histogram"] == [0, 2, 1, 2, 1]
    nxt = metrics.record(torch.tensor([1]), torch.tensor([2]))  # the sums start again after a snapshot
    assert nxt is None and metrics.take().acceptance_histogram == (0, 1, 0, 0, 0)


def test_recording_the_histogram_reads_nothing_back_to_the_host():
    metrics = RoundMetrics(100, "cpu", lambda s: None, max_acceptance=16)
    with HostReads() as reads:
        metrics.record(torch.tensor([1, 5, 16]), torch.tensor([33, 33, 33]), branching=torch.tensor([1, 1, 0]) > 0)
    assert reads.seen == []


def test_bulk_observation_writes_what_observing_one_by_one_writes():
    counts = {1.0: 3, 2.0: 0, 4.0: 5, 9.0: 2}  # 9 lands in +Inf
    bulk, single = CollectorRegistry(), CollectorRegistry()
    px.observe_counts(Histogram("h_tokens", "d", registry=bulk, buckets=[1, 2, 3, 4]), counts)
    one = Histogram("h_tokens", "d", registry=single, buckets=[1, 2, 3, 4])
    for value, n in counts.items():
        for _ in range(n):
            one.observe(value)
    assert samples(bulk) == samples(single)
    assert samples(bulk)[("h_tokens_count", ())] == 10


def test_the_export_carries_every_snapshot_sum_under_prometheus_names():
    registry = CollectorRegistry()
    export = px.PrometheusExport("tiny", budget=8, max_acceptance=6, registry=registry)
    before = samples(registry)
    labels = (("budget", "8"), ("model_name", "tiny"))

    def bucket(le: str) -> tuple:
        return px.ACCEPTANCE_LENGTH + "_bucket", tuple(sorted(labels + (("le", le),)))

    assert before[(px.BUDGET, labels)] == 8  # the budget is there before any round
    assert before[(px.ROUNDS + "_total", labels)] == 0
    snapshots = []
    metrics = RoundMetrics(2, "cpu", snapshots.append, max_acceptance=6)
    for accepted, build_ms in (([1, 2], 0.4), ([6, 6], 2.0), ([3], 30.0), ([1, 1, 1], 0.2)):
        metrics.record(torch.tensor(accepted), torch.full((len(accepted),), 9), lambda ms=build_ms: ms,
                       branching=torch.tensor(accepted) > 1)
    for snapshot in snapshots:
        export.export(snapshot)
    got = samples(registry)
    assert got[(px.ACCEPTANCE_LENGTH + "_count", labels)] == 8
    assert got[(px.ACCEPTANCE_LENGTH + "_sum", labels)] == 21
    assert (got[bucket("1.0")], got[bucket("5.0")], got[bucket("6.0")], got[bucket("+Inf")]) == (4, 6, 8, 8)
    assert got[(px.TREE_TOKENS + "_total", labels)] == 72
    assert got[(px.BRANCHING_TREES + "_total", labels)] == 4
    assert got[(px.ROUNDS + "_total", labels)] == 4
    assert got[(px.TREE_BUILD_SECONDS + "_count", labels)] == 4
    assert got[(px.TREE_BUILD_SECONDS + "_sum", labels)] == pytest.approx(0.0326)
    assert got[(px.TREE_BUILD_SECONDS + "_bucket", tuple(sorted(labels + (("le", "0.001"),))))] == 2


def test_names_follow_prometheus_conventions():
    registry = CollectorRegistry()
    px.PrometheusExport("m", budget=4, max_acceptance=4, registry=registry)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
                if not f.name.endswith("_created")}  # in-process only: SGLang's multi-process /metrics has none
    assert set(families) == set(px.FAMILIES)
    for name, family in families.items():
        assert name.startswith("ddtree_") and name.endswith(("_tokens", "_seconds", "_nodes", "_trees", "_rounds"))
        assert (family.type == "counter") == (name in px.COUNTERS)
        if family.type == "counter":
            assert all(s.name in (name + "_total", name + "_created") for s in family.samples)
        assert all(set(s.labels) - {"le"} == set(px.LABELS) for s in family.samples)
