"""What `ddtree-ops smoke` costs per host, on a real loopback sshd fleet.

Measures, in one run:
  - wall time of `smoke` on 1 host and on 4 hosts (target: 4 within 1.5x of 1), for the light
    stages (env,import,golden: the runner's own overhead dominates) and for a CPU-heavy set
    (+invariants; on a machine with fewer cores than hosts that part cannot scale), next to
    the CPU time of the CLI process itself (the operator-side cost that a real fleet sees);
  - the same with every host capped at `--host-cores` of CPU in its own cgroup
    (`cpu_groups.py`; root and a cgroup-v1 cpu controller), so a host is as fast beside three
    others as alone, as on a real fleet: what is left of the 4-vs-1 ratio is the fan-out's;
  - SSH connections opened per host per run (counted at the client's socket connect) and
    Python interpreter starts per host per run (the hosts' `python` is a wrapper that logs
    each start), split into the push agent and the smoke runner.
The release is pushed once before timing, so every timed run is a no-op push + the smoke run.

Usage: .venv/bin/python benchmarks/smoke_overhead.py [--repeat 3] [--host-cores 0.45]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from sshd_fleet import SshdFleet, sshd_available  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import cpu_groups  # noqa: E402
from bench_args import positive_int  # noqa: E402

from ddtree_ops.cli.app import main  # noqa: E402

LIGHT = "env,import,golden"
HEAVY = "env,import,golden,invariants"


def python_wrapper(directory: Path, log: Path, threads: int | None = None) -> Path:
    """A `python` for the hosts that records each start (what it runs) and execs the real one;
    with `threads`, torch's intra-op pool is capped (the loopback hosts share this machine)."""
    script = directory / f"python-counting-{threads or 'all'}"
    script.write_text(
        "#!/bin/sh\n"
        + (f"export OMP_NUM_THREADS={threads}\n" if threads else "")
        + f'case "$1" in *runner.py) what=runner;; *) what=agent;; esac\n'
        f'echo "$PPID $what" >> {log}\n'
        f'exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return script


@contextlib.contextmanager
def count_connects(ports: set[int]):
    """Count TCP connects this process makes to the fleet's ports."""
    counts: collections.Counter = collections.Counter()
    original = socket.socket.connect

    def connect(self, address):
        if isinstance(address, tuple) and address[1] in ports:
            counts[address[1]] += 1
        return original(self, address)

    socket.socket.connect = connect
    try:
        yield counts
    finally:
        socket.socket.connect = original


def quiet_main(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def one_run(inventory: Path, hosts: str, stages: str, ports: set[int], starts_log: Path):
    starts_log.write_text("")
    with count_connects(ports) as connects:
        began, cpu_began = time.perf_counter(), time.process_time()
        code = quiet_main(["smoke", "-i", str(inventory), "-H", hosts, "--stages", stages])
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    starts = collections.Counter(line.split()[1] for line in starts_log.read_text().splitlines())
    return code, wall, cpu, sum(connects.values()), starts


def measure(sets, repeat: int, ports: set[int], starts_log: Path) -> list[tuple]:
    """One row per (stage set, 1 or 4 hosts): medians over `repeat` runs."""
    rows = []
    for label, stages, inv in sets:
        for hosts in ("h0", "h0,h1,h2,h3"):
            n = hosts.count(",") + 1
            walls, cpus, connects, starts = [], [], [], collections.Counter()
            for _ in range(repeat):
                code, wall, cpu, conns, started = one_run(inv, hosts, stages, ports, starts_log)
                if code != 0:
                    main(["report"])
                    sys.exit(f"smoke failed (exit {code}) on {hosts} {stages}")
                walls.append(wall)
                cpus.append(cpu)
                connects.append(conns / n)
                starts = started
            rows.append((label, stages, n, statistics.median(walls), statistics.median(cpus),
                         statistics.median(connects), starts["agent"] / n, starts["runner"] / n))
    return rows


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--host-cores", type=float, default=0.45,
                        help="CPU cap per host for the capped rows (4 hosts x 0.45 leave the CLI "
                             "a share of 2 cores); 0 skips them")
    args = parser.parse_args()
    cap_skipped = "--host-cores 0" if args.host_cores <= 0 else cpu_groups.unavailable()
    if not sshd_available():
        sys.exit("needs OpenSSH sshd (scripts/bootstrap.sh installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        os.environ["DDTREE_OPS_RUNS_DIR"] = str(base / "runs")
        starts_log = base / "python-starts.log"
        (base / "fleet").mkdir()
        fleet = SshdFleet(base / "fleet", python=str(python_wrapper(base, starts_log)),
                          command_timeout=600)
        fleet.start(4)
        try:
            inventory = fleet.write_inventory()
            ports = {h.port for h in fleet.hosts}
            assert quiet_main(["push", "-i", str(inventory)]) == 0  # timed runs: no-op push
            one_thread = fleet.write_inventory(
                base / "one-thread.yaml",
                host_overrides={h.name: {"python": str(python_wrapper(base, starts_log, 1))}
                                for h in fleet.hosts})
            # heavy runs with one torch thread per host: 4 hosts x N threads on this machine's
            # few cores would measure OpenMP oversubscription, not smoke.
            sets = (("light", LIGHT, inventory), ("heavy", HEAVY, one_thread))
            rows = measure(sets, args.repeat, ports, starts_log)
            if not cap_skipped:
                sshds = {h.name: h.proc.pid for h in fleet.hosts}
                with cpu_groups.capped(sshds, args.host_cores):
                    rows += measure([(f"{label} capped", stages, inv) for label, stages, inv in sets],
                                    args.repeat, ports, starts_log)
        finally:
            fleet.stop()
    base_wall = {row[0]: row[3] for row in rows if row[2] == 1}
    print(f"smoke on a loopback sshd fleet, median of {args.repeat} runs, {os.cpu_count()} CPU(s)")
    print(f"{'stages':<13} {'hosts':>5} {'wall s':>8} {'vs 1 host':>9} {'CLI cpu s':>9} "
          f"{'ssh conn/host':>13} {'py starts/host':>14} {'(push agent':>11} {'runner)':>7}")
    for label, stages, n, wall, cpu, conns, agent, runner in rows:
        print(f"{label:<13} {n:>5} {wall:>8.2f} {wall / base_wall[label]:>8.2f}x {cpu:>9.2f} "
              f"{conns:>13.1f} {agent + runner:>14.1f} {agent:>11.1f} {runner:>7.1f}")
    print(f"light = {LIGHT}; heavy = {HEAVY} with OMP_NUM_THREADS=1 per host")
    if cap_skipped:
        print(f"capped rows skipped: {cap_skipped}")
    else:
        print(f"capped = each host's sshd and all it forks held to {args.host_cores} of a core "
              f"(cgroup cpu quota), the same in the 1-host and the 4-host runs")


if __name__ == "__main__":
    main_bench()
