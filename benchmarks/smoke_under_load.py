"""The default `ddtree-ops smoke -H local` on a quiet host and beside busy-loop processes.

GPU eval hosts are rarely idle. This runs the default smoke profile, as an operator would
(`ddtree-ops smoke -H local --json`), in interleaved pairs: once as the host is, once with
`--busy` extra busy-loop processes (default 4). It prints each run's wall time, how busy the
host was before it and the slowest stages, then min/median/max per condition and the ratio of the
medians (target: the busy runs within 2x of the quiet ones).

Where the busy loops run matters on Linux, whose scheduler (with autogroups, the default on
desktop and most server kernels) shares the CPUs between sessions first: `--loops one-session`
(default) starts them in one session of their own, like four loops started from one other
shell; `--loops own-sessions` gives each its own, like four unrelated jobs, and leaves the
smoke a smaller share (2 CPUs shared by 5 sessions: two fifths of one CPU).

A "quiet" run is only as quiet as the host: how many CPUs were busy in the second before it
is printed beside it (from /proc/stat; Linux only). If that is high, the ratio says little and
the table says so.

Usage: .venv/bin/python benchmarks/smoke_under_load.py [--pairs 3] [--busy 4] [--loops own-sessions]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_args import non_negative_int, positive_int  # noqa: E402
from cpu_stat import IDLE, IOWAIT, cpu_fields  # noqa: E402

BUSY_LOOP = "while True: pass"


def start_busy_loops(count: int, own_sessions: bool) -> list[subprocess.Popen]:
    loop = [sys.executable, "-c", BUSY_LOOP]
    if own_sessions:
        return [subprocess.Popen(loop, start_new_session=True) for _ in range(count)]
    # One session (and process group) for all of them, killed together.
    script = " ".join(f"{shlex.join(loop)} &" for _ in range(count)) + " wait"
    return [subprocess.Popen(["sh", "-c", script], start_new_session=True)] if count else []


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        os.killpg(process.pid, signal.SIGKILL)  # each leads its own session: the loops go with it
    for process in processes:
        process.wait()


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat (Linux only)."""
    fields = cpu_fields()
    if fields is None:
        raise OSError("/proc/stat is not readable: this benchmark needs Linux")
    idle = fields[IDLE] + (fields[IOWAIT] if len(fields) > IOWAIT else 0)
    return sum(fields) - idle, sum(fields)


def busy_cpus(seconds: float = 1.0) -> float:
    """How many CPUs were busy over the last `seconds` (the 1-min load average lags a minute
    behind: right after a busy run it still counts the loops that were just stopped)."""
    busy_0, total_0 = cpu_ticks()
    time.sleep(seconds)
    busy_1, total_1 = cpu_ticks()
    return (os.cpu_count() or 1) * (busy_1 - busy_0) / max(1, total_1 - total_0)


def run_smoke(cli: Path, workdir: Path) -> tuple[float, float, dict[str, float], int]:
    """(wall s, CPUs busy just before, {stage: seconds}, exit code) of one default smoke run."""
    load_before = busy_cpus()
    started = time.monotonic()
    done = subprocess.run([str(cli), "smoke", "-H", "local", "--json"], cwd=workdir,
                          capture_output=True, text=True)
    wall = time.monotonic() - started
    stages: dict[str, float] = {}
    try:
        host = json.loads(done.stdout)["hosts"]["local"]
        stages = {name: stage["duration_s"] for name, stage in host["stages"].items()
                  if isinstance(stage.get("duration_s"), (int, float))}
    except (ValueError, KeyError, TypeError):
        pass  # the exit code below says the run failed
    return wall, load_before, stages, done.returncode


def summary(values: list[float]) -> str:
    return f"{min(values):6.1f} / {statistics.median(values):6.1f} / {max(values):6.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=positive_int, default=3, help="quiet/busy pairs (default 3)")
    parser.add_argument("--busy", type=non_negative_int, default=4, help="busy-loop processes (default 4)")
    parser.add_argument("--loops", choices=("one-session", "own-sessions"), default="one-session",
                        help="the busy loops share one session (default) or each has its own")
    args = parser.parse_args()
    cli = Path(sys.executable).parent / "ddtree-ops"
    cpus = os.cpu_count() or 1
    walls: dict[str, list[float]] = {"quiet": [], "busy": []}
    quiet_loads: list[float] = []
    failed = 0
    print(f"default `ddtree-ops smoke -H local`, {args.pairs} interleaved pairs, "
          f"{args.busy} busy loops ({args.loops}), {cpus} CPUs, started {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print("| run | condition | wall s | CPUs busy before | slowest stages (s) | exit |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)  # results land here, not in the checkout
        run_smoke(cli, workdir)  # warm-up: the first run pushes the release
        for pair in range(args.pairs):
            for condition in ("quiet", "busy"):
                loops = start_busy_loops(args.busy, args.loops == "own-sessions") if condition == "busy" else []
                try:
                    if loops:
                        time.sleep(1)  # let the loops get scheduled before timing
                    wall, load, stages, code = run_smoke(cli, workdir)
                finally:
                    stop(loops)
                walls[condition].append(wall)
                if condition == "quiet":
                    quiet_loads.append(load)
                failed += code != 0
                slowest = ", ".join(f"{name} {seconds:.1f}" for name, seconds in
                                    sorted(stages.items(), key=lambda item: -item[1])[:3])
                print(f"| {pair + 1} | {condition} | {wall:.1f} | {load:.2f} | {slowest} | {code} |")
    ratio = statistics.median(walls["busy"]) / statistics.median(walls["quiet"])
    print(f"\nquiet  min/median/max s: {summary(walls['quiet'])}")
    print(f"busy   min/median/max s: {summary(walls['busy'])}")
    verdict = "within" if ratio <= 2 else "NOT within"
    print(f"busy/quiet median ratio: {ratio:.2f}x ({verdict} the 2x bound)")
    if max(quiet_loads) > 0.5:
        print(f"note: a quiet run started with {max(quiet_loads):.2f} CPUs busy: the host was not quiet, "
              f"so this ratio understates what the busy loops cost")
    if failed:
        print(f"{failed} run(s) did not exit 0: their times are not those of a passing smoke")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
