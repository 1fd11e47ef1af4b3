"""Tree-build speed: the heap oracle vs the public builder vs the top-k floor vs the batch.

    python benchmarks/tree_build.py [--calls 20] [--draws 4] [--threads N] [--quick] [--vocab V ...]

Per (vocab, row kind, budget) and for each of --draws requests drawn from the same kind of
rows, medians over --calls calls, the methods interleaved call by call (in a fresh random
order each round) so a busy machine slows them alike. The ratio a/b moves with the draw (on
drafter-like rows by +-15 %), so the table gives its geometric mean over the draws and the
worst draw, not one draw's figure. glibc's malloc thresholds are fixed first (`steady_malloc`;
`--default-malloc` leaves them) so that one call's freed memory cannot make the next call's
temporaries page-fault:
  (a) heap     build_ddtree_tree_from_logits(method="heap"): the reference semantics
  (b) public   build_ddtree_tree_from_logits(...) default (AUTO)
  (c) floor    torch.topk(k=budget) + torch.logsumexp over [D, V] alone (the reference's tensor work)
  (d) batch/r  build_ddtree_trees on 8 requests, per request
Rows: `flat` = randn logits; `peaked` = drafter-like, one dominant token per row (p ~ 0.9)
over a randn * 2 tail; `few-peaks` = the smoke `tree-bench` stage's rows, four likely tokens
(logits 9, 7.5, 6.5, 6) over a randn tail (a tree mostly one level deep with a few longer
paths). With CUDA present it also prints the device rows: a batch of 16 bf16 requests at
budget 256, eager (CUDA events, sync-debug mode "error" around the builder) and as a CUDA
graph replay (`GraphedTreeBuilder`), and the peak extra memory at batch 16, budget 1024.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
from ddtree import BuildMethod, GraphedTreeBuilder, build_ddtree_tree_from_logits, build_ddtree_trees  # noqa: E402
from smoke.stages.tree_bench import drafter_like_logits  # noqa: E402

DEPTH = 15
VOCABS = (151936, 32000)
BUDGETS = (16, 64, 256, 512, 1024)
BATCH = 8


def make_logits(kind: str, batch: int, vocab: int, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """[batch, D, V] float32."""
    if kind == "flat":
        logits = torch.randn(batch, DEPTH, vocab, generator=generator)
    elif kind == "few-peaks":  # the smoke `tree-bench` stage's own rows, seeded from this run's stream
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        logits = drafter_like_logits(torch, batch, DEPTH, vocab, seed, "cpu")
    else:
        logits = torch.randn(batch, DEPTH, vocab, generator=generator) * 2.0
        top = torch.randint(0, vocab, (batch, DEPTH, 1), generator=generator)
        logits.scatter_add_(2, top, torch.full((batch, DEPTH, 1), 16.0))
    return logits.to(device)


def interleaved_medians(functions: dict, calls: int) -> dict[str, float]:
    """Median seconds per function; every round calls each function once, in a fresh random
    order (seeded). A call that follows another over the same logits finds them in the CPU
    caches, so neither a fixed order nor a rotation (which keeps each function's predecessor)
    may decide which function always comes after which."""
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
    return {name: statistics.median(values) for name, values in samples.items()}


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
        f"python {platform.python_version()}, load average at start {load:.2f}"
    )


def cpu_table(calls: int, budgets, vocabs, draws: int) -> None:
    generator = torch.Generator().manual_seed(0)
    print(f"CPU: {machine()}")
    print(
        f"medians over {calls} interleaved calls (random order each round; the batch timed apart, over "
        f"{batch_calls(calls)} calls), on each of {draws} "
        f"requests drawn per case; ms: the median request; a/b: the geometric mean of the requests' ratios and "
        f"the worst one; D = {DEPTH}, float32 logits\n"
    )
    header = "| vocab | rows | budget | (a) heap ms | (b) public ms | (c) floor ms | (d) batch/req ms | a/b | a/b worst | b/c | depth |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for vocab in vocabs:
        for kind in ("flat", "peaked", "few-peaks"):
            batch = make_logits(kind, BATCH, vocab, generator)
            requests = [batch[r].contiguous() for r in range(min(draws, BATCH))]
            for budget in budgets:
                per_request = [single_request_medians(one, budget, calls) for one in requests]
                ms = {name: statistics.median(t[name] for t in per_request) * 1e3 for name in per_request[0]}
                ratios = [t["heap"] / t["public"] for t in per_request]
                # the batch (8x the data) would evict the rows the others share, so it is timed apart
                ms["batch"] = interleaved_medians({"batch": lambda: build_ddtree_trees(batch, budget)},
                                                  batch_calls(calls))["batch"] * 1e3
                depths = sorted({build_ddtree_tree_from_logits(one, budget).max_depth for one in requests})
                print(
                    f"| {vocab} | {kind} | {budget} | {ms['heap']:.2f} | {ms['public']:.2f} | {ms['floor']:.2f} "
                    f"| {ms['batch'] / BATCH:.2f} | {statistics.geometric_mean(ratios):.2f}x | {min(ratios):.2f}x "
                    f"| {ms['public'] / ms['floor']:.2f}x | {'-'.join(map(str, (depths[0], depths[-1]) if len(depths) > 1 else depths))} |",
                    flush=True,
                )


def batch_calls(calls: int) -> int:
    """The batch holds 8 requests' data: fewer calls keep the run short (said in the header)."""
    return max(5, calls // 4)


def single_request_medians(one: torch.Tensor, budget: int, calls: int) -> dict[str, float]:
    """(a)-(c) on one [D, V] request: they read the same rows, so each finds them in the caches
    the others left (interleaved, so none is favoured)."""
    return interleaved_medians(
        {
            "heap": lambda: build_ddtree_tree_from_logits(one, budget, method=BuildMethod.HEAP),
            "public": lambda: build_ddtree_tree_from_logits(one, budget),
            "floor": lambda: (torch.topk(one, min(budget, one.shape[-1]), dim=-1), torch.logsumexp(one, dim=-1)),
        },
        calls,
    )


def cuda_rows(calls: int) -> None:
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(1)
    print(f"\nCUDA: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("| case | median ms | note |")
    print("|---|---|---|")
    for vocab in VOCABS:
        logits = make_logits("peaked", 16, vocab, generator, device).to(torch.bfloat16)
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

        big = make_logits("peaked", 16, vocab, generator, device).to(torch.bfloat16)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per median (>= 20 for the docs)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--draws", type=int, default=4, help=f"requests timed per case (1..{BATCH}); ratios vary with the draw")
    parser.add_argument("--quick", action="store_true", help="budgets 16 and 1024, vocab 32000 only, 2 draws")
    parser.add_argument("--vocab", type=int, action="append", help="vocabulary size (repeatable; default 151936 and 32000)")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's adaptive malloc thresholds on (noisy)")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.draws < 1:
        parser.error(f"--draws must be >= 1, got {args.draws}")
    bad_vocab = [v for v in args.vocab or () if v < 1]
    if bad_vocab:
        parser.error(f"--vocab must be >= 1, got {bad_vocab[0]}")
    print("malloc left as is (--default-malloc)" if args.default_malloc else steady_malloc())
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = (16, 1024) if args.quick else BUDGETS
    vocabs = tuple(args.vocab) if args.vocab else (32000,) if args.quick else VOCABS
    cpu_table(args.calls, budgets, vocabs, 2 if args.quick else min(args.draws, BATCH))
    if torch.cuda.is_available():
        cuda_rows(args.calls)
    else:
        print("\nCUDA: not available on this machine; device rows skipped")


if __name__ == "__main__":
    main()
