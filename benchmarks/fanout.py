"""Fan-out speed on a loopback fleet of real sshd processes, measured in one run.

    .venv/bin/python benchmarks/fanout.py [--hosts 8] [--repeat 5] [--scale 64] [--scale-repeat 3]
    .venv/bin/python benchmarks/fanout.py --login-user ddtree-bench --host-python /opt/bench-venv/bin/python

The second form logs in as an existing account whose login shell runs no rc files, so the
figures show ddtree-ops rather than the login shell's start-up (root's `.bashrc` here runs
`pyenv init`, ~90 ms of CPU per SSH session). Make the account and a Python it can run once,
as root: `useradd -m -s /bin/sh -p '*' ddtree-bench` (`-p '*'`: not locked, no password), `python3 -m venv /opt/bench-venv` (with the
system Python) and `/opt/bench-venv/bin/pip install torch==2.13.0` (`hosts check` wants torch).

Every figure is the wall time of a whole `ddtree-ops` process (CLI start included), median of
`--repeat` interleaved rounds; "fresh" hosts get new, empty workdirs each time. The sshd processes share this
machine's cores with the client, so remote work is not free here. Prints a Markdown table.

A second table (`--scale N`, default 64; 0 skips it) starts N sshd and measures `push` to N
fresh hosts, a no-op `push` and `hosts check` against the same on 1 host, in interleaved
rounds: wall time (min / median / max) and the client process's CPU time and peak memory
(from its rusage), in total and per host.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bench_args import non_negative_int, positive_int  # noqa: E402  (benchmarks/, the script's folder)
from sshd_fleet import SshdFleet, sshd_available  # noqa: E402

CLI = str(Path(sys.executable).with_name("ddtree-ops"))


def timed(argv: list[str], *, expect: int = 0) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != expect:
        raise SystemExit(f"{' '.join(argv[:4])}...: exit {done.returncode}\n{done.stderr[-2000:]}")
    return elapsed


def measured(argv: list[str]) -> tuple[float, float, int]:
    """(wall s, client CPU s (user + system), client peak RSS in KiB) of one ddtree-ops process."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}...: exit {proc.returncode}\n{stderr.decode()[-2000:]}")
    return elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss


def median_of(repeat: int, run) -> float:
    return statistics.median(run(i) for i in range(repeat))


def fresh_inventory(fleet: SshdFleet, tag: str) -> Path:
    overrides = {h.name: {"workdir": str(h.directory / f"work-{tag}")} for h in fleet.hosts}
    return fleet.write_inventory(fleet.base / f"hosts-{tag}.yaml", host_overrides=overrides)


def stage_bundle_files(target: Path) -> int:
    """The release's files in their repository layout, for rsync to copy."""
    from ddtree_ops.release import build_bundle

    bundle = build_bundle()
    for entry in bundle.files:
        path = target / entry.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(entry.source, path)
    return len(bundle.files)


def openssh(fleet: SshdFleet) -> str:
    return (
        f"ssh -i {fleet.client_key} -o UserKnownHostsFile={fleet.known_hosts} -o StrictHostKeyChecking=yes "
        f"-o BatchMode=yes -o ConnectTimeout=5 -F /dev/null"
    )


def ssh_true(fleet: SshdFleet, hosts: int) -> float:
    """The floor for any SSH tool here: OpenSSH running `true` (connection + login shell)."""
    started = time.perf_counter()
    procs = [
        subprocess.Popen([*openssh(fleet).split(), "-l", fleet.login_user, "-p", str(h.port), "127.0.0.1", "true"])
        for h in fleet.hosts[:hosts]
    ]
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit("ssh true failed")
    return time.perf_counter() - started


def rsync_all(fleet: SshdFleet, source: Path, tag: str) -> float:
    ssh = openssh(fleet)
    started = time.perf_counter()
    procs = []
    for host in fleet.hosts:
        dest = host.directory / f"rsync-{tag}"
        procs.append(subprocess.Popen(
            ["rsync", "-a", "-e", f"{ssh} -p {host.port}", f"{source}/", f"{fleet.login_user}@127.0.0.1:{dest}/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        ))
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"rsync failed: {proc.stderr.read().decode()[-500:]}")
    return time.perf_counter() - started


HELP_CALLS = 5  # `--help` is timed on its own, median of this many calls


def help_facts() -> tuple[float, list[str]]:
    code = (
        "import contextlib, io, sys\nfrom ddtree_ops.cli.app import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
        "print(','.join(m for m in ('torch', 'fabric', 'paramiko') if m in sys.modules))"
    )
    heavy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return median_of(HELP_CALLS, lambda i: timed([CLI, "--help"])), [m for m in heavy.split(",") if m]


def scale_rows(n: int, repeat: int, python: str, login_user: Optional[str]) -> list[str]:
    """push (fresh), no-op push and hosts check to n hosts, against 1 host in the same run:
    wall time, and the client's CPU and peak memory in total and per host."""
    base = Path(tempfile.mkdtemp(prefix="ddtree-fanout-scale-"))
    fleet = None
    samples: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    try:
        fleet = SshdFleet(base, command_timeout=300, python=python, login_user=login_user).start(n)
        warm = fresh_inventory(fleet, "warm")
        measured([CLI, "push", "-i", str(warm)])
        for i in range(repeat):  # interleaved: load from other work hits every row alike
            for hosts in (1, n):
                select = ["-H", "h0"] if hosts == 1 else []
                for key, argv in (
                    ("push, fresh", [CLI, "push", "-i", str(fresh_inventory(fleet, f"s{i}-{hosts}")), *select]),
                    ("push, no-op", [CLI, "push", "-i", str(warm), *select]),
                    ("hosts check", [CLI, "hosts", "check", "-i", str(warm), *select]),
                ):
                    samples.setdefault((key, hosts), []).append(measured(argv))
                    if key == "push, fresh":
                        for host in fleet.hosts:  # fresh workdirs of this round are not needed again
                            shutil.rmtree(host.directory / f"work-s{i}-{hosts}", ignore_errors=True)
    finally:
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(base, ignore_errors=True)

    def spread(values: list[float], unit: str = "") -> str:
        return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}{unit}"

    lines = [f"| measurement | wall s min / median / max | ratio to 1 host | client CPU s (median) | CPU s per host "
             f"| CPU s per extra host | client peak RSS MiB | RSS per extra host KiB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for key in ("push, fresh", "push, no-op", "hosts check"):
        one, many = samples[(key, 1)], samples[(key, n)]
        wall1, walln = statistics.median(s[0] for s in one), statistics.median(s[0] for s in many)
        cpu1, cpun = statistics.median(s[1] for s in one), statistics.median(s[1] for s in many)
        rss1, rssn = statistics.median(s[2] for s in one), statistics.median(s[2] for s in many)
        lines.append(f"| {key}, 1 host | {spread([s[0] for s in one])} | baseline | {cpu1:.3f} | {cpu1:.3f} "
                     f"| - | {rss1 / 1024:.1f} | - |")
        lines.append(f"| {key}, {n} hosts | {spread([s[0] for s in many])} | {walln / wall1:.2f}x | {cpun:.3f} "
                     f"| {cpun / n:.4f} | {(cpun - cpu1) / (n - 1):.4f} | {rssn / 1024:.1f} "
                     f"| {(rssn - rss1) / (n - 1):.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=positive_int, default=8)
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--login-user", help="log in to the loopback hosts as this existing account (root only)")
    parser.add_argument("--host-python", default=sys.executable, help="the hosts' `python:` (readable by that account)")
    parser.add_argument("--scale", type=non_negative_int, default=64,
                        help="also push / no-op push / hosts check to this many hosts with client CPU and memory "
                             "per host (0: skip)")
    parser.add_argument("--scale-repeat", type=positive_int, default=3)
    args = parser.parse_args()
    if args.login_user:
        import pwd

        try:
            pwd.getpwnam(args.login_user)
        except KeyError:
            parser.error(f"--login-user: no account named {args.login_user!r} on this machine")
    if not sshd_available() or not shutil.which("rsync"):
        raise SystemExit("needs sshd, ssh-keygen and rsync (scripts/bootstrap.sh installs them)")
    n, repeat = args.hosts, args.repeat
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="ddtree-fanout-bench-"))
    fleet = None
    try:  # the fleet's folder holds a client private key: removed however the run ends
        fleet = SshdFleet(base, command_timeout=120, python=args.host_python, login_user=args.login_user).start(n)
        staged = base / "staged"
        files = stage_bundle_files(staged)
        # Interleaved rounds: load from other work on the machine hits every row alike.
        warm = fresh_inventory(fleet, "warm")
        timed([CLI, "push", "-i", str(warm)])
        rsync_all(fleet, staged, "warm")
        samples: dict[str, list[float]] = {}
        for i in range(repeat):
            for key, run in (
                ("one", lambda: timed([CLI, "push", "-i", str(fresh_inventory(fleet, f"one{i}")), "-H", "h0"])),
                ("many", lambda: timed([CLI, "push", "-i", str(fresh_inventory(fleet, f"many{i}"))])),
                ("noop", lambda: timed([CLI, "push", "-i", str(warm)])),
                ("rsync_first", lambda: rsync_all(fleet, staged, f"first{i}")),
                ("rsync_noop", lambda: rsync_all(fleet, staged, "warm")),
                ("check_one", lambda: timed([CLI, "hosts", "check", "-i", str(warm), "-H", "h0"])),
                ("check_many", lambda: timed([CLI, "hosts", "check", "-i", str(warm)])),
                ("true_one", lambda: ssh_true(fleet, 1)),
                ("true_many", lambda: ssh_true(fleet, n)),
            ):
                samples.setdefault(key, []).append(run())
        one, many, noop, rsync_first, rsync_noop, check_one, check_many, true_one, true_many = (
            statistics.median(samples[k])
            for k in ("one", "many", "noop", "rsync_first", "rsync_noop", "check_one", "check_many",
                      "true_one", "true_many")
        )
        help_s, heavy = help_facts()
    finally:
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(base, ignore_errors=True)

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    rows = [
        ("push, 1 fresh host", one, "-", "baseline"),
        (f"push, {n} fresh hosts", many, f"{many / one:.2f}x of 1 host", verdict(many <= 2 * one) + " (<= 2x)"),
        (f"push, no-op re-push to {n} hosts", noop, "-", verdict(noop < 1.0) + " (< 1 s)"),
        (f"rsync -a, {n} fresh hosts in parallel", rsync_first, f"push is {rsync_first / many:.2f}x faster",
         verdict(many < rsync_first) + " (push faster)"),
        (f"rsync -a, no-op re-run to {n} hosts", rsync_noop, f"push no-op is {rsync_noop / noop:.2f}x faster", "reference"),
        ("hosts check, 1 host", check_one, "-", "baseline"),
        (f"hosts check, {n} hosts", check_many, f"{check_many / check_one:.2f}x of 1 host", verdict(check_many <= 2 * check_one) + " (<= 2x)"),
        ("floor: OpenSSH `ssh host true`, 1 host", true_one, "-", "reference (connection + login shell)"),
        (f"floor: OpenSSH `ssh host true`, {n} hosts in parallel", true_many, f"{true_many / true_one:.2f}x of 1 host",
         "reference"),
        (f"ddtree-ops --help (median of {HELP_CALLS})", help_s, f"heavy imports: {', '.join(heavy) or 'none'}", verdict(help_s < 0.3 and not heavy) + " (< 0.3 s, no torch/fabric/paramiko)"),
    ]
    print(f"fan-out on a loopback fleet: {n} sshd, {files} release files, median of {repeat}, "
          f"login user {fleet.login_user}, host python {args.host_python}, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average before/after "
          f"{load_before:.1f}/{os.getloadavg()[0]:.1f} (other work on the machine inflates every figure)")
    print()
    print("| measurement | wall s | ratio | target |")
    print("|---|---:|---|---|")
    for name, seconds, ratio, target in rows:
        print(f"| {name} | {seconds:.3f} | {ratio} | {target} |")
    if args.scale > 1:  # 0 (or 1): no fleet-size rows
        load_before = os.getloadavg()[0]
        lines = scale_rows(args.scale, args.scale_repeat, args.host_python, args.login_user)
        print()
        print(f"fleet size: {args.scale} sshd on loopback against 1 host, {args.scale_repeat} interleaved rounds, "
              f"default --parallel; client = the ddtree-ops process (os.wait4 rusage); load average before/after "
              f"{load_before:.1f}/{os.getloadavg()[0]:.1f}")
        print()
        print("\n".join(lines))


if __name__ == "__main__":
    main()
