"""Tree-build speed per row family: the heap oracle vs the public builder vs the one-pass floor.

    python benchmarks/tree_build.py [--calls 15] [--draws 2] [--threads 2] [--family NAME ...]
                                    [--budgets 16,32,...] [--vocab V ...] [--quick]

Rows come from the seeded families of `benchmarks/row_families.py` (flat, peaked, few-peaks,
power-law rows with exponents 1.0-2.5 with and without depth-dependent sharpening, temperature
copies, a mix whose depths differ in shape, a DFlash drafter's block over the tiny test target),
D = 15, float32. Per (family, budget) and for each
of --draws requests of that family, the three single-request functions are called once per
round, in a fresh random order each round (a busy machine slows them alike); medians over
--calls rounds:
  (a) heap     build_ddtree_tree_from_logits(method="heap"): the reference semantics
  (b) public   build_ddtree_tree_from_logits(...) default (AUTO)
  (c) floor    torch.logsumexp over the [D, V] rows: one pass over the data, which every
               exact builder pays (a row's log-probs need its logsumexp, bit for bit)
  (d) batch/r  build_ddtree_trees on a batch of 8 requests of the family, per request (timed
               apart: the batch's 8x data would evict what the others share)
a/b is the ratio of the medians (geometric mean over the draws) with the min / median / max of
the per-round ratios beside it (all draws pooled). Each line carries the load average when its
timing ended and the share of CPU time the hypervisor stole meanwhile (`steal`, /proc/stat: on
a shared VM a few percent make single timings noisy, tens of percent make them noise).
glibc's malloc thresholds are fixed first (`steady_malloc`; `--default-malloc` leaves them) so
one call's freed memory cannot make the next call's temporaries page-fault. With CUDA present
it also prints the device rows: a batch of 16 bf16 requests at budget 256, eager (CUDA
events, sync-debug mode "error" around the builder) and as a CUDA graph replay
(`GraphedTreeBuilder`), the peak extra memory at batch 16, budget 1024, and one request at
V = 32000 on the device, heap against the public builder (AUTO's full-row choices).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

# OpenMP threads that spin while waiting time the scheduler, not the code, on a shared machine
# (a [15, 151936] logsumexp took 160 ms instead of 3 at load 14 on 2 cores); set before torch
# loads, and printed with the table. OMP_WAIT_POLICY=ACTIVE in the environment restores spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ddtree import BuildMethod, GraphedTreeBuilder, build_ddtree_tree_from_logits, build_ddtree_trees  # noqa: E402
from bench_args import budget_list, positive_int  # noqa: E402
from cpu_stat import STEAL, cpu_fields  # noqa: E402
from row_families import FAMILIES, family_logits  # noqa: E402

DEPTH = 15
VOCABS = (151936,)
BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
BATCH = 8


def family_batch(name: str, batch: int, vocab: int, device="cpu") -> torch.Tensor:
    """[batch, D, V] float32: requests 0..batch-1 of family `name` (request r is seed r)."""
    return torch.stack([family_logits(name, seed, DEPTH, vocab) for seed in range(batch)]).to(device)


def interleaved_samples(functions: dict, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each function, `calls` rounds; every round calls each function once,
    in a fresh random order (seeded). A call that follows another over the same logits finds
    them in the CPU caches, so neither a fixed order nor a rotation (which keeps each
    function's predecessor) may decide which function always comes after which."""
    for fn in functions.values():
        fn()  # warm-up
    names = list(functions)
    order = random.Random(len(names) * 1000 + calls)
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(calls):
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            functions[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def steady_malloc() -> str:
    """Fix glibc malloc's thresholds for this process and say so. By default glibc moves its
    mmap threshold as blocks are freed and returns freed heap to the system, so whether a
    call's multi-MB temporaries (a [15, 151936] float copy is 9 MB) come from fresh pages,
    with a page fault per 4 KiB, depends on what the previous call freed: interleaved, one
    builder's median moved by up to 40 % from one repetition to the next. Run alone, each
    builder settles either way (measured: the same medians with and without this)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        # M_MMAP_THRESHOLD (-3) at glibc's 32 MiB maximum, M_TRIM_THRESHOLD (-1), M_TOP_PAD (-2)
        applied = libc.mallopt(-3, 32 * 2**20) and libc.mallopt(-1, 2**30) and libc.mallopt(-2, 64 * 2**20)
    except (OSError, AttributeError):
        applied = 0
    return "glibc malloc thresholds fixed" if applied else "malloc left as is (no glibc)"


def machine() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"python {platform.python_version()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"load average at start {load:.2f}"
    )


def cpu_table(calls: int, budgets, vocabs, draws: int, families) -> None:
    print(f"CPU: {machine()}")
    print(
        f"medians over {calls} interleaved rounds (random order each round) on each of {draws} requests per "
        f"case; the batch timed apart over {batch_calls(calls)} calls; ms: the median request; a/b: ratio of the "
        f"medians (geometric mean over the requests), then min / median / max of the per-round ratios; "
        f"D = {DEPTH}, float32 logits\n"
    )
    header = ("| vocab | family | budget | (a) heap ms | (b) public ms | (c) floor ms | (d) batch/req ms "
              "| a/b | a/b per round min / med / max | b/c | depth | load | steal |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for vocab in vocabs:
        for family in families:
            batch = family_batch(family, BATCH, vocab)
            requests = [batch[r].contiguous() for r in range(min(draws, BATCH))]
            for budget in budgets:
                ticks = cpu_ticks()
                per_request = [single_request_samples(one, budget, calls) for one in requests]
                medians = [{name: statistics.median(v) for name, v in t.items()} for t in per_request]
                ms = {name: statistics.median(m[name] for m in medians) * 1e3 for name in medians[0]}
                ratio = statistics.geometric_mean([m["heap"] / m["public"] for m in medians])
                rounds = sorted(h / p for t in per_request for h, p in zip(t["heap"], t["public"]))
                batch_s = interleaved_samples({"batch": lambda: build_ddtree_trees(batch, budget)}, batch_calls(calls))
                ms["batch"] = statistics.median(batch_s["batch"]) * 1e3
                depths = sorted({build_ddtree_tree_from_logits(one, budget).max_depth for one in requests})
                print(
                    f"| {vocab} | {family} | {budget} | {ms['heap']:.2f} | {ms['public']:.2f} | {ms['floor']:.2f} "
                    f"| {ms['batch'] / BATCH:.2f} | {ratio:.2f}x | {rounds[0]:.2f} / {statistics.median(rounds):.2f} / "
                    f"{rounds[-1]:.2f} | {ms['public'] / ms['floor']:.2f}x "
                    f"| {'-'.join(map(str, (depths[0], depths[-1]) if len(depths) > 1 else depths))} "
                    f"| {os.getloadavg()[0]:.1f} | {steal_share(ticks, cpu_ticks())} |",
                    flush=True,
                )


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, all) CPU jiffies so far (`cpu_stat`), else None. Steal is the time the
    hypervisor ran another guest on this VM's CPUs: a timing taken then is slowed by something
    the load average does not show."""
    fields = cpu_fields()
    if fields is None:
        return None
    return (fields[STEAL] if len(fields) > STEAL else 0), sum(fields[: STEAL + 1])


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """The share of this machine's CPU time stolen between two `cpu_ticks()`."""
    if before is None or after is None or after[1] <= before[1]:
        return "n/a"
    return f"{100 * (after[0] - before[0]) / (after[1] - before[1]):.0f} %"


def batch_calls(calls: int) -> int:
    """The batch holds 8 requests' data: fewer calls keep the run short (said in the header)."""
    return max(5, calls // 4)


def single_request_samples(one: torch.Tensor, budget: int, calls: int) -> dict[str, list[float]]:
    """(a)-(c) on one [D, V] request: they read the same rows, so each finds them in the caches
    the others left (interleaved, so none is favoured)."""
    return interleaved_samples(
        {
            "heap": lambda: build_ddtree_tree_from_logits(one, budget, method=BuildMethod.HEAP),
            "public": lambda: build_ddtree_tree_from_logits(one, budget),
            "floor": lambda: torch.logsumexp(one, dim=-1),
        },
        calls,
    )


def cuda_rows(calls: int) -> None:
    device = torch.device("cuda")
    print(f"\nCUDA: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("| case | median ms | note |")
    print("|---|---|---|")
    for vocab in VOCABS:
        logits = family_batch("peaked", 16, vocab, device).to(torch.bfloat16)
        build_ddtree_trees(logits, 256)  # warm-up (kernels, caches)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside the builder raises
        try:
            build_ddtree_trees(logits, 256)
            sync_note = "no host sync (sync-debug mode 'error')"
        except RuntimeError as err:
            sync_note = f"HOST SYNC: {str(err).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        samples = []
        for _ in range(calls):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            build_ddtree_trees(logits, 256)
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop))
        print(f"| batch 16 x [15, {vocab}] bf16, budget 256, eager | {statistics.median(samples):.3f} | {sync_note} |")

        graphed = GraphedTreeBuilder(16, 15, vocab, 256, dtype=torch.bfloat16, device=device)
        samples = []
        for _ in range(calls):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphed(logits)  # copy into the static input, then one graph launch
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop))
        del graphed
        print(f"| batch 16 x [15, {vocab}] bf16, budget 256, CUDA graph replay | {statistics.median(samples):.3f} | input copy included |")

        big = family_batch("power-1.5-sharp", 16, vocab, device).to(torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        trees = build_ddtree_trees(big, 1024)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        del trees
        print(f"| batch 16 x [15, {vocab}] bf16, budget 1024: peak extra memory | {peak:.1f} MiB | target < 64 MB |")

        one = logits[0]
        samples = []
        for _ in range(calls):
            torch.cuda.synchronize()
            start_time = time.perf_counter()
            build_ddtree_tree_from_logits(one, 256)
            samples.append((time.perf_counter() - start_time) * 1e3)
        print(f"| public builder, one [15, {vocab}] bf16 request on CUDA, budget 256 | {statistics.median(samples):.3f} | host tree out |")
    full_row_rows_on_cuda(device, calls)


def full_row_rows_on_cuda(device: torch.device, calls: int) -> None:
    """One request at V = 32000 (rows read by full-row top-k): AUTO's pick (the lazy heap below
    budget 1024, FAST's own pick from 1024) against the heap, interleaved, on the device. The
    CPU crossovers were measured on the CPU only; these rows say whether they hold on CUDA."""
    for family in ("peaked", "few-peaks", "power-2.0"):
        one = family_logits(family, 0, DEPTH, 32000).to(device)
        for budget in (128, 512, 1024):
            def synced(method):
                def call():
                    build_ddtree_tree_from_logits(one, budget, method)
                    torch.cuda.synchronize()
                return call
            samples = interleaved_samples({"heap": synced(BuildMethod.HEAP), "auto": synced(BuildMethod.AUTO)}, calls)
            heap, auto = (statistics.median(samples[k]) * 1e3 for k in ("heap", "auto"))
            print(f"| one [15, 32000] float32 {family} request on CUDA, budget {budget}: heap / public | "
                  f"{heap:.3f} / {auto:.3f} | {heap / auto:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=positive_int, default=15, help="interleaved rounds per median (>= 15 for the docs)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--draws", type=positive_int, default=2, help=f"requests timed per case (1..{BATCH}); ratios vary with the draw")
    parser.add_argument("--family", action="append", choices=FAMILIES, help="row family (repeatable; default: all)")
    parser.add_argument("--budgets", type=budget_list, default=list(BUDGETS), help="comma-separated budgets")
    parser.add_argument("--quick", action="store_true", help="budgets 16 and 1024, 1 draw, 5 rounds")
    parser.add_argument("--vocab", type=positive_int, action="append", help="vocabulary size (repeatable; default 151936)")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's adaptive malloc thresholds on (noisy)")
    args = parser.parse_args()
    print("malloc left as is (--default-malloc)" if args.default_malloc else steady_malloc())
    torch.set_num_threads(args.threads)
    budgets = (16, 1024) if args.quick else tuple(args.budgets)
    vocabs = tuple(args.vocab) if args.vocab else VOCABS
    calls, draws = (5, 1) if args.quick else (args.calls, min(args.draws, BATCH))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu_table(calls, budgets, vocabs, draws, args.family or FAMILIES)
    print(f"\nstarted {started}, load average at the end {os.getloadavg()[0]:.2f}")
    if torch.cuda.is_available():
        cuda_rows(args.calls)
    else:
        print("\nCUDA: not available on this machine; device rows skipped")


if __name__ == "__main__":
    main()
