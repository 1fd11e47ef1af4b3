"""docs/grafana/ddtree-dashboard.json asks only for series that exist: every query names a
series the plugin exports (as its exporter writes it, read back with prometheus_client's
parser) or one SGLang 0.5.23 declares (its metrics_collector.py, read from the real wheel),
and groups or filters only by labels those series carry (or Prometheus adds at scrape)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.sglang.prometheus_export import LABELS, PrometheusExport
from sglang_plugin.dist import sglang_site

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "ddtree-dashboard.json"
SCRAPE_LABELS = {"instance", "job", "le"}  # added by Prometheus (instance, job) or the histogram (le)
SGLANG_SCHEDULER_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank", "priority",
                           "is_streaming"}  # metrics_collector.py:1382-1392 and its token counters
METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]")
PREFIXED = re.compile(r"\b(ddtree_[a-zA-Z0-9_]*|sglang:[a-zA-Z0-9_:]*)")


def queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def plugin_series() -> set[str]:
    registry = CollectorRegistry()
    PrometheusExport("m", budget=8, max_acceptance=16, registry=registry)
    return {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
            if not s.name.endswith("_created")}


def sglang_series() -> set[str]:
    """Sample names of every Counter/Gauge/Histogram SGLang's collectors declare by name."""
    source = (sglang_site() / "sglang" / "srt" / "observability" / "metrics_collector.py").read_text()
    names = set()
    for call in ast.walk(ast.parse(source)):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        name = next((k.value.value for k in call.keywords if k.arg == "name" and isinstance(k.value, ast.Constant)), None)
        if not isinstance(name, str) or not name.startswith("sglang:"):
            continue
        kind = call.func.id
        if kind == "Counter":
            names.add(name if name.endswith("_total") else name + "_total")
        elif kind == "Gauge":
            names.add(name)
        elif kind == "Histogram":
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_the_dashboard_is_grafana_json_with_queries():
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["panels"] and len(queries()) >= 10


@pytest.mark.slow  # reads the real sglang wheel (cached after the first test that needs it)
def test_every_query_names_series_that_are_exported():
    ours, theirs = plugin_series(), sglang_series()
    assert {"sglang:gen_throughput", "sglang:generation_tokens_total"} <= theirs  # the reader finds SGLang's names
    used_ours = set()
    for expr in queries():
        named = set(METRIC.findall(expr)) | set(PREFIXED.findall(expr))
        named -= {"by", "rate", "sum", "max", "histogram_quantile", "label_values"}
        assert named, f"names no series: {expr}"
        unknown = {n for n in named if n not in ours and n not in theirs}
        assert not unknown, f"{sorted(unknown)} is exported by neither the plugin nor SGLang: {expr}"
        used_ours |= named & ours
        allowed = set(LABELS) | SCRAPE_LABELS | (SGLANG_SCHEDULER_LABELS if named & theirs else set())
        grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        filtered = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*\"", expr))
        assert grouped | filtered <= allowed, f"labels {sorted((grouped | filtered) - allowed)} are on no series: {expr}"
    # acceptance by budget, tree size, build time and rounds are all shown
    assert {"ddtree_acceptance_length_tokens_sum", "ddtree_tree_tokens_total", "ddtree_tree_build_seconds_bucket",
            "ddtree_rounds_total", "ddtree_budget_nodes", "ddtree_branching_trees_total"} <= used_ours
