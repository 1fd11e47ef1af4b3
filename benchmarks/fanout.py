"""Fan-out speed on a loopback fleet of real sshd processes, measured in one run.

    .venv/bin/python benchmarks/fanout.py [--hosts 8] [--repeat 5]
    .venv/bin/python benchmarks/fanout.py --login-user ddtree-bench --host-python /opt/bench-venv/bin/python

The second form logs in as an existing account whose login shell runs no rc files, so the
figures show ddtree-ops rather than the login shell's start-up (root's `.bashrc` here runs
`pyenv init`, ~90 ms of CPU per SSH session). Make the account and a Python it can run once,
as root: `useradd -m -s /bin/sh -p '*' ddtree-bench` (`-p '*'`: not locked, no password), `python3 -m venv /opt/bench-venv` (with the
system Python) and `/opt/bench-venv/bin/pip install torch==2.13.0` (`hosts check` wants torch).

Every figure is the wall time of a whole `ddtree-ops` process (CLI start included), median of
`--repeat` interleaved rounds; "fresh" hosts get new, empty workdirs each time. The sshd processes share this
machine's cores with the client, so remote work is not free here. Prints a Markdown table.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bench_args import positive_int  # noqa: E402  (benchmarks/, the script's folder)
from sshd_fleet import SshdFleet, sshd_available  # noqa: E402

CLI = str(Path(sys.executable).with_name("ddtree-ops"))


def timed(argv: list[str], *, expect: int = 0) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != expect:
        raise SystemExit(f"{' '.join(argv[:4])}...: exit {done.returncode}\n{done.stderr[-2000:]}")
    return elapsed


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=positive_int, default=8)
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--login-user", help="log in to the loopback hosts as this existing account (root only)")
    parser.add_argument("--host-python", default=sys.executable, help="the hosts' `python:` (readable by that account)")
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


if __name__ == "__main__":
    main()
