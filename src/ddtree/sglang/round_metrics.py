"""DDTree metrics inside the server: accumulated on the device, read every N rounds.

SGLang's built-in "accept rate" divides by N-1 (the verify width), which for a tree is the
node budget, so it is not comparable with linear DFlash. We log the acceptance length
(accepted tree indices per round, root included), the tree size, how many trees branched
(more nodes than depth: wider than one path, which linear DFlash never verifies) and the
tree-build time from CUDA events, with one host sync per `interval` rounds. Each snapshot is
logged twice: a line for people and `DDTree metrics {json}` for programs (tests, smoke), and,
with SGLang's `--enable-metrics`, exported to its Prometheus endpoint
(ddtree.sglang.prometheus_export): the snapshot carries exact sums and the acceptance
histogram for that.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

JSON_PREFIX = "DDTree metrics "


@dataclass(frozen=True)
class MetricsSnapshot:
    rounds: int
    requests: int  # request-rounds
    mean_acceptance_length: float  # accepted tree indices per request-round, root included
    mean_tree_size: float  # tree tokens per request-round, root included
    mean_build_ms: Optional[float]  # tree build + packing per round (None: not timed)
    branching_trees: int = 0  # request-rounds whose tree has more nodes than depth
    # Exact sums behind the means (the Prometheus series are these, summed over snapshots):
    # acceptance_histogram[L] = request-rounds that accepted L tree indices (root included).
    acceptance_histogram: tuple[int, ...] = ()
    tree_tokens: int = 0  # tree tokens over the request-rounds, root included
    timed_rounds: int = 0  # rounds with a build time
    build_ms_total: float = 0.0
    build_ms_each: tuple[float, ...] = field(default=(), repr=False)  # per timed round; not logged

    def line(self) -> str:
        build = "n/a" if self.mean_build_ms is None else f"{self.mean_build_ms:.3f} ms"
        return (
            f"DDTree: {self.rounds} rounds, {self.requests} request-rounds, acceptance length "
            f"{self.mean_acceptance_length:.3f}, tree size {self.mean_tree_size:.1f}, "
            f"{self.branching_trees} branching trees, tree build {build}"
        )

    def json_line(self) -> str:
        return JSON_PREFIX + json.dumps(self.to_dict(), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        fields = dict(self.__dict__)
        fields.pop("build_ms_each")  # the histogram's input, not the log line's
        fields["acceptance_histogram"] = list(self.acceptance_histogram)
        return fields


class RoundMetrics:
    """Device-side sums; `record` never syncs. `take()` syncs once and resets."""

    def __init__(self, interval: int, device: torch.device | str,
                 emit: Callable[[MetricsSnapshot], None], max_acceptance: int = 1):
        self.interval = interval
        self.emit = emit
        # Acceptance is at most the drafter's block size B (depth <= B-1, plus the root); the
        # histogram has a bin per length 0..max_acceptance, filled on the device.
        self._histogram = torch.zeros(max(int(max_acceptance), 1) + 1, dtype=torch.int64, device=device)
        self._accepted = torch.zeros((), dtype=torch.int64, device=device)
        self._tree_tokens = torch.zeros((), dtype=torch.int64, device=device)
        self._branching = torch.zeros((), dtype=torch.int64, device=device)
        self._requests = 0
        self._rounds = 0
        self._build_ms: list[Callable[[], float]] = []  # lazily read timings

    def record(
        self,
        accept_lens: torch.Tensor,  # [bs] int accepted tree indices (root included)
        tree_sizes: torch.Tensor,  # [bs] int tree tokens (root included)
        build_ms: Optional[Callable[[], float]] = None,  # e.g. start.elapsed_time(end)
        branching: Optional[torch.Tensor] = None,  # [bs] bool tree wider than one path
    ) -> Optional[MetricsSnapshot]:
        if self.interval <= 0:
            return None
        self._accepted += accept_lens.sum().to(torch.int64)
        lengths = accept_lens.to(torch.int64).clamp(0, self._histogram.shape[0] - 1)
        self._histogram.index_add_(0, lengths, torch.ones_like(lengths))  # no sync (bincount would)
        self._tree_tokens += tree_sizes.sum().to(torch.int64)
        if branching is not None:
            self._branching += branching.sum().to(torch.int64)
        self._requests += int(accept_lens.shape[0])
        self._rounds += 1
        if build_ms is not None:
            self._build_ms.append(build_ms)
        if self._rounds < self.interval:
            return None
        snapshot = self.take()
        self.emit(snapshot)
        return snapshot

    def take(self) -> MetricsSnapshot:
        requests = max(self._requests, 1)
        accepted = float(self._accepted.item())  # the sync: every recorded event is complete after it
        tree_tokens = float(self._tree_tokens.item())
        branching = int(self._branching.item())
        timings = [float(read()) for read in self._build_ms]
        snapshot = MetricsSnapshot(
            rounds=self._rounds,
            requests=self._requests,
            mean_acceptance_length=accepted / requests,
            mean_tree_size=tree_tokens / requests,
            mean_build_ms=(sum(timings) / len(timings)) if timings else None,
            branching_trees=branching,
            acceptance_histogram=tuple(int(n) for n in self._histogram.tolist()),
            tree_tokens=int(tree_tokens),
            timed_rounds=len(timings),
            build_ms_total=sum(timings),
            build_ms_each=tuple(timings),
        )
        self._accepted.zero_()
        self._histogram.zero_()
        self._tree_tokens.zero_()
        self._branching.zero_()
        self._requests = self._rounds = 0
        self._build_ms = []
        return snapshot


def trees_branch(trees: Any) -> torch.Tensor:
    """[bs] bool: the tree has more nodes than its depth, i.e. some node has two children
    (a TreeBatch: depths [bs, B] 1..D with padding 0, num_nodes [bs])."""
    return trees.num_nodes > trees.depths.amax(dim=1)
