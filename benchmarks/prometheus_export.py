"""What exporting the plugin's series costs the scheduler thread, per RoundMetrics snapshot.

    .venv/bin/python benchmarks/prometheus_export.py [--repeat 7] [--interval 50]

In prometheus_client's multi-process mode, as inside SGLang with --enable-metrics (a fresh
PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported): one snapshot of
`--interval` rounds at each batch size, exported by `PrometheusExport.export` (the acceptance
histogram observed in one step per length), beside the baseline measured in the same rounds:
the same histogram observed once per request-round with `Histogram.observe`. Acceptance lengths
are drawn uniformly from 1..16 (a block-16 drafter). Wall time min / median / max over
`--repeat` interleaved rounds; the host's load average before and after under the table.
Prints Markdown.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench_args import positive_int  # noqa: E402  (benchmarks/, the script's folder)

BLOCK = 16
BATCHES = (1, 64, 256)


def snapshot(rounds: int, batch: int, rng: random.Random):
    from ddtree.sglang.round_metrics import MetricsSnapshot

    histogram = [0] * (BLOCK + 1)
    for _ in range(rounds * batch):
        histogram[rng.randint(1, BLOCK)] += 1
    return MetricsSnapshot(rounds=rounds, requests=rounds * batch, mean_acceptance_length=0.0, mean_tree_size=0.0,
                           mean_build_ms=1.0, acceptance_histogram=tuple(histogram), tree_tokens=rounds * batch * 33,
                           timed_rounds=rounds, build_ms_total=float(rounds), build_ms_each=(1.0,) * rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=positive_int, default=7)
    parser.add_argument("--interval", type=positive_int, default=50, help="rounds per snapshot (DDTREE_METRICS_INTERVAL)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="prom-mp-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder  # before prometheus_client is imported, as SGLang does
    from prometheus_client import Histogram

    from ddtree.sglang.prometheus_export import ACCEPTANCE_LENGTH, PrometheusExport

    load_before = os.getloadavg()
    export = PrometheusExport("bench", budget=32, max_acceptance=BLOCK)
    single = Histogram(ACCEPTANCE_LENGTH + "_single", "baseline", ["model_name", "budget"], registry=None,
                       buckets=[float(n) for n in range(1, BLOCK + 1)]).labels(model_name="bench", budget="32")
    rng = random.Random(0)
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeat):
        for batch in BATCHES:
            shot = snapshot(args.interval, batch, rng)
            started = time.perf_counter()
            export.export(shot)
            times.setdefault((batch, "export"), []).append(time.perf_counter() - started)
            started = time.perf_counter()
            for length, count in enumerate(shot.acceptance_histogram):
                for _ in range(count):
                    single.observe(length)
            times.setdefault((batch, "one by one"), []).append(time.perf_counter() - started)
    load_after = os.getloadavg()
    print(f"| batch | request-rounds per snapshot | export ms (min / median / max) | one observe per request-round ms "
          f"(min / median / max) | export / one by one (median) |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        ours, base = times[(batch, "export")], times[(batch, "one by one")]
        cell = lambda xs: " / ".join(f"{1e3 * v:.3f}" for v in (min(xs), statistics.median(xs), max(xs)))  # noqa: E731
        print(f"| {batch} | {batch * args.interval} | {cell(ours)} | {cell(base)} | "
              f"{statistics.median(ours) / statistics.median(base):.3f} |")
    print(f"\n{args.repeat} rounds, interval {args.interval}; load average (1/5/15 min) before "
          f"{' '.join(f'{v:.2f}' for v in load_before)}, after {' '.join(f'{v:.2f}' for v in load_after)}; "
          f"prometheus_client multi-process mode. The export also updates the build-time histogram "
          f"({args.interval} observations) and the counters; the baseline only the acceptance histogram.")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
