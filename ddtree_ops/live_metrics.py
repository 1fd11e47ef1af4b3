"""A serving SGLang's `/metrics` text read as DDTree's live figures (`ddtree-ops status`).

The text comes from a host, so it is parsed with prometheus_client's own parser and every
value is checked before it is used: a malformed text is a RemoteStepError naming the host.
The family names are the plugin's own (ddtree.sglang.prometheus_export), never spelled here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from ddtree.sglang import prometheus_export as px

from ddtree_ops.errors import RemoteStepError

# What `status` asks the host to send back of /metrics (families whose names start so): the
# plugin's series, and SGLang's own throughput and load beside them.
GEN_THROUGHPUT = "sglang:gen_throughput"
RUNNING_REQUESTS = "sglang:num_running_reqs"
METRIC_PREFIXES = ("ddtree_", GEN_THROUGHPUT, RUNNING_REQUESTS)


@dataclass(frozen=True)
class LiveReading:
    """DDTree in one server since it started (sums over its label sets: one per DP rank)."""

    ddtree: bool  # the DDTree worker exports its series: DDTree is on in this server
    budget: Optional[int]  # ddtree_budget_nodes (None: DDTree is off, or several budgets)
    request_rounds: int
    accepted_tokens: float  # the acceptance histogram's sum
    rounds: int
    tree_tokens: float
    branching_trees: int
    build_rounds: int
    build_seconds: float
    gen_throughput: Optional[float]  # SGLang's own tokens/s gauge
    running_requests: Optional[float]

    @property
    def acceptance_length(self) -> Optional[float]:
        return self.accepted_tokens / self.request_rounds if self.request_rounds else None

    @property
    def mean_tree_size(self) -> Optional[float]:
        return self.tree_tokens / self.request_rounds if self.request_rounds else None

    @property
    def mean_build_ms(self) -> Optional[float]:
        return 1e3 * self.build_seconds / self.build_rounds if self.build_rounds else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_length": self.acceptance_length, "mean_tree_size": self.mean_tree_size,
                "mean_build_ms": self.mean_build_ms}


def parse_metrics(host: str, text: str) -> LiveReading:
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    budgets: set[float] = set()
    seen: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            seen.add(family.name)
            for sample in family.samples:
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    if sample.name.startswith("ddtree_"):  # ours are counts; SGLang's gauges may be NaN
                        raise ValueError(f"{sample.name}: {value!r} is not a count")
                    continue
                if sample.name == px.BUDGET:
                    budgets.add(value)
                sums[sample.name] = sums.get(sample.name, 0.0) + value
    except (ValueError, TypeError, IndexError, KeyError) as err:  # what the parser raises on bad text
        raise RemoteStepError(f"{host}: /metrics: not Prometheus' text format: {str(err)[:200]}") from None

    def count(name: str) -> int:
        return int(sums.get(name, 0))

    return LiveReading(
        ddtree=px.BUDGET in seen,
        budget=int(budgets.pop()) if len(budgets) == 1 else None,
        request_rounds=count(px.ACCEPTANCE_LENGTH + "_count"),
        accepted_tokens=sums.get(px.ACCEPTANCE_LENGTH + "_sum", 0.0),
        rounds=count(px.ROUNDS + "_total"),
        tree_tokens=sums.get(px.TREE_TOKENS + "_total", 0.0),
        branching_trees=count(px.BRANCHING_TREES + "_total"),
        build_rounds=count(px.TREE_BUILD_SECONDS + "_count"),
        build_seconds=sums.get(px.TREE_BUILD_SECONDS + "_sum", 0.0),
        gen_throughput=sums.get(GEN_THROUGHPUT),  # None: not served (or not a number)
        running_requests=sums.get(RUNNING_REQUESTS),
    )
