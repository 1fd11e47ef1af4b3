"""`ddtree-ops push` against parallel rsync, scp and parallel-ssh, on one loopback fleet of real
sshd processes, in one interleaved run.

    .venv/bin/python benchmarks/push_peers.py [--hosts 1,8,64] [--repeat 3] [--parallel 32]
    .venv/bin/python benchmarks/push_peers.py --login-user ddtree-bench --host-python /opt/bench-venv/bin/python
    .venv/bin/python benchmarks/push_peers.py --compare /path/to/other-checkout/.venv/bin/python

Needs sshd, rsync, scp and parallel-ssh: `apt-get install openssh-server openssh-client rsync pssh`
(Debian names the pssh tools `parallel-ssh`, `parallel-scp`; scripts/bootstrap.sh installs the
rest). The second form logs in as an account whose login shell runs no rc files (see
benchmarks/fanout.py for setting one up).

Every tool sends the same tree (the release's files in their repository layout) from this
machine to each selected host, at most `--parallel` hosts at once (push's default, parallel-ssh's
`-p`, a pool of that many rsync or scp processes):
- ddtree-ops: `ddtree-ops push --source TREE` (a whole CLI process: start, bundle, verify,
  atomic switch, prune);
- rsync: `rsync -a --delete -e ssh TREE/ host:DEST/`, one process per host;
- scp: `scp -O -r -q` of the tree's top folders into DEST, one process per host (always sends all;
  `-O`: the classic protocol, as the loopback sshd runs no SFTP subsystem);
- parallel-ssh: `tar c TREE | parallel-ssh -I 'mkdir -p DEST && tar x -C DEST'` (the hosts share
  one filesystem and one account here, so parallel-scp's one remote path cannot give each its
  own folder; `$HOME` does: each loopback host has its own);
- with `--compare PYTHON`, also the `ddtree-ops push` beside that interpreter (another
  checkout's, say `main`), as one more tool.

Three workloads per host count: cold (empty destinations), nothing changed (the same tree again),
one file changed (a line added to one module, new every round). Rounds are interleaved (each
round runs every host count, workload and tool, the tools' order rotating), so load from other
work hits every tool alike. After every run each host's copy is checked file by file by sha256
against the tree (untimed). Each row: wall time min / median / max; the client's CPU (every
process the tool ran here, from rusage) and the hosts' CPU (every sshd and what it ran, from the
listening sshd's own and reaped children's times), medians; the 1-minute load average over the
row's runs. The sshd processes share this machine's cores with the clients, so host CPU
competes with client CPU here as it would not on a real fleet.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

from bench_args import positive_int  # noqa: E402
from bytecode import bytecode_env  # noqa: E402
from fanout import openssh, stage_bundle_files  # noqa: E402
from sshd_fleet import SshdFleet, SshdHost, descendants, sshd_available  # noqa: E402

CLI = str(Path(sys.executable).with_name("ddtree-ops"))
PEERS = ("rsync", "scp", "parallel-ssh")
COMPARED = "ddtree-ops (compared)"
WORKLOADS = ("cold", "nothing changed", "one file changed")
CHANGED_FILE = "src/ddtree/__init__.py"  # the file a "one file changed" round edits
ENV = bytecode_env()


@dataclass
class Sample:
    wall: float
    client_cpu: float
    host_cpu: float
    load: float


def host_counts(text: str) -> list[int]:
    counts = [positive_int(part) for part in text.split(",")]
    return sorted(set(counts))


class Bench:
    def __init__(self, fleet: SshdFleet, tree: Path, parallel: int, base: Path, compared_cli: Optional[str]):
        self.fleet, self.tree, self.parallel, self.base = fleet, tree, parallel, base
        self.clis = {"ddtree-ops": CLI, **({COMPARED: compared_cli} if compared_cli else {})}
        self.ssh = openssh(fleet)
        self.expected: dict[str, str] = {}

    # ------------------------------------------------------------ where each tool puts the tree

    def dest(self, tool: str, host: SshdHost, tag: str) -> Path:
        """The folder on `host` that holds the tree after `tool` ran (push: its active release)."""
        if tool in self.clis:
            return self.workdir(tool, host, tag) / "current"
        return host.directory / f"{tool}-{tag}"

    def workdir(self, tool: str, host: SshdHost, tag: str) -> Path:
        return host.directory / f"push-{'compared-' if tool == COMPARED else ''}{tag}"

    def inventory(self, tool: str, hosts: list[SshdHost], tag: str) -> Path:
        doc = self.fleet.inventory_dict(host_overrides={h.name: {"workdir": str(self.workdir(tool, h, tag))}
                                                        for h in self.fleet.hosts})
        doc["hosts"] = {h.name: doc["hosts"][h.name] for h in hosts}
        path = self.base / f"hosts-{tool == COMPARED}-{tag}-{len(hosts)}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    # ------------------------------------------------------------ the tools

    def run_tool(self, tool: str, hosts: list[SshdHost], tag: str) -> None:
        if tool in self.clis:
            self.each([[self.clis[tool], "push", "-i", str(self.inventory(tool, hosts, tag)), "--source", str(self.tree),
                        "--parallel", str(self.parallel)]])
        elif tool == "rsync":
            self.each([["rsync", "-a", "--delete", "-e", f"{self.ssh} -p {h.port}", f"{self.tree}/",
                        f"{self.fleet.login_user}@127.0.0.1:{self.dest(tool, h, tag)}/"] for h in hosts])
        elif tool == "scp":
            for host in hosts:  # scp copies into an existing folder (made here, untimed: shared filesystem)
                self.dest(tool, host, tag).mkdir(exist_ok=True)
            tops = sorted(p.name for p in self.tree.iterdir())
            self.each([["scp", "-O", "-r", "-q", *self.ssh.split()[1:], "-P", str(h.port), *tops,
                        f"{self.fleet.login_user}@127.0.0.1:{self.dest(tool, h, tag)}/"] for h in hosts], cwd=self.tree)
        elif tool == "parallel-ssh":
            hosts_file = self.base / f"pssh-{len(hosts)}.txt"
            hosts_file.write_text("".join(f"{self.fleet.login_user}@127.0.0.1:{h.port}\n" for h in hosts))
            options = " ".join(f"-O {o}" for o in self.ssh.split() if "=" in o)  # -o K=V as pssh's -O K=V
            remote = f'mkdir -p "$HOME/{tool}-{tag}" && tar x -C "$HOME/{tool}-{tag}"'
            self.each([["sh", "-c", f"tar c -C {self.tree} . | parallel-ssh -I -p {self.parallel} -t 300 "
                                    f"-h {hosts_file} -x '-i {self.fleet.client_key} -F /dev/null' {options} "
                                    f"'{remote}'"]])
        else:
            raise ValueError(tool)

    def each(self, commands: list[list[str]], cwd: Optional[Path] = None) -> None:
        """Run the commands, at most --parallel at once; every one must succeed."""
        def one(argv: list[str]) -> None:
            done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(argv[:3])}...: exit {done.returncode}\n{done.stderr.decode()[-1500:]}")

        with ThreadPoolExecutor(max_workers=min(self.parallel, len(commands))) as pool:
            list(pool.map(one, commands))

    # ------------------------------------------------------------ measuring

    def host_cpu(self, hosts: list[SshdHost]) -> float:
        """CPU seconds of the hosts' listening sshd processes and every child they reaped."""
        ticks = 0
        for host in hosts:
            fields = Path(f"/proc/{host.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        return ticks / os.sysconf("SC_CLK_TCK")

    def settle(self, hosts: list[SshdHost], timeout: float = 10) -> None:
        """Until every session of these hosts has ended and been reaped (its CPU then counts)."""
        deadline = time.monotonic() + timeout
        while any(descendants(h.proc.pid) for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.01)

    def measure(self, tool: str, hosts: list[SshdHost], tag: str) -> Sample:
        self.settle(hosts)
        host_before = self.host_cpu(hosts)
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        self.run_tool(tool, hosts, tag)
        wall = time.perf_counter() - started
        client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.settle(hosts)
        host_after = self.host_cpu(hosts)
        for host in hosts:
            self.check_copy(tool, host, tag)
        return Sample(wall, client_after.ru_utime + client_after.ru_stime - client_before.ru_utime
                      - client_before.ru_stime, host_after - host_before, os.getloadavg()[0])

    def snapshot(self) -> None:
        """What every copy must hold now: relpath -> sha256 of the tree."""
        self.expected = {p.relative_to(self.tree).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in self.tree.rglob("*") if p.is_file()}

    def check_copy(self, tool: str, host: SshdHost, tag: str) -> None:
        root = self.dest(tool, host, tag)
        found = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in root.rglob("*") if p.is_file() and p.name != "MANIFEST.sha256"}
        if found != self.expected:
            wrong = sorted(k for k in set(found) | set(self.expected) if found.get(k) != self.expected.get(k))
            raise SystemExit(f"{tool} left {root} differing from the tree in {len(wrong)} file(s), first {wrong[:3]}")

    def change_one_file(self, round_: int) -> None:
        path = self.tree / CHANGED_FILE
        path.write_text(path.read_text() + f"# push_peers round {round_}\n")
        self.snapshot()


def tools_of(args: argparse.Namespace) -> tuple[str, ...]:
    return ("ddtree-ops", *PEERS, *((COMPARED,) if args.compare else ()))


def compared_cli(python: Optional[str]) -> Optional[str]:
    if python is None:
        return None
    cli = Path(python).with_name("ddtree-ops")
    if not cli.is_file():
        raise SystemExit(f"--compare: no ddtree-ops beside {python}")
    return str(cli)


def run(args: argparse.Namespace) -> tuple[dict[tuple[int, str, str], list[Sample]], int]:
    base = Path(tempfile.mkdtemp(prefix="ddtree-push-peers-"))
    fleet = None
    samples: dict[tuple[int, str, str], list[Sample]] = {}
    try:  # the fleet's folder holds a client private key: removed however the run ends
        fleet = SshdFleet(base, command_timeout=600, python=args.host_python, login_user=args.login_user)
        fleet.start(max(args.hosts))
        tree = base / "tree"
        files = stage_bundle_files(tree)
        bench = Bench(fleet, tree, args.parallel, base, compared_cli(args.compare))
        bench.snapshot()
        for cli in bench.clis:  # untimed: writes the bytecode the timed runs read
            bench.run_tool(cli, fleet.hosts[:1], "bytecode")
        every = tools_of(args)
        for round_ in range(args.repeat):
            tools = every[round_ % len(every):] + every[:round_ % len(every)]  # rotating order
            for count in args.hosts:
                hosts = fleet.hosts[:count]
                for tool in tools:  # cold: folders never used before
                    samples.setdefault((count, "cold", tool), []).append(
                        bench.measure(tool, hosts, f"r{round_}-n{count}"))
                    if round_ == 0:  # the warm copies: first made by round 0's cold run
                        bench.run_tool(tool, hosts, f"warm-n{count}")
                for tool in tools:
                    samples.setdefault((count, "nothing changed", tool), []).append(
                        bench.measure(tool, hosts, f"warm-n{count}"))
                bench.change_one_file(round_ * len(args.hosts) + args.hosts.index(count))
                for tool in tools:
                    samples.setdefault((count, "one file changed", tool), []).append(
                        bench.measure(tool, hosts, f"warm-n{count}"))
                for tool in tools:  # the cold copies are not needed again
                    for host in hosts:
                        root = bench.dest(tool, host, f"r{round_}-n{count}")
                        shutil.rmtree(root.parent if tool in bench.clis else root, ignore_errors=True)
        return samples, files
    finally:
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(base, ignore_errors=True)


def report(samples: dict[tuple[int, str, str], list[Sample]], args: argparse.Namespace, files: int,
           load_before: tuple[float, float, float]) -> None:
    def spread(values: list[float]) -> str:
        return f"{min(values) * 1000:.0f} / {statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}"

    def median(key: tuple[int, str, str], field: Callable[[Sample], float]) -> float:
        return statistics.median(field(s) for s in samples[key])

    print(f"push against its peers: loopback sshd fleet, {files} release files, {args.repeat} interleaved rounds, "
          f"--parallel {args.parallel}, login user {args.login_user or 'this one'}, host python {args.host_python}, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cores; load average before "
          f"{'/'.join(f'{v:.1f}' for v in load_before)}, after {'/'.join(f'{v:.1f}' for v in os.getloadavg())}")
    print()
    print("| hosts | workload | tool | wall ms min / median / max | peer / push (median) | client CPU ms | "
          "host CPU ms | load (1 min) |")
    print("|---:|---|---|---|---:|---:|---:|---|")
    verdicts = []
    for count in args.hosts:
        for workload in WORKLOADS:
            ours = median((count, workload, "ddtree-ops"), lambda s: s.wall)
            for tool in tools_of(args):
                key = (count, workload, tool)
                walls = [s.wall for s in samples[key]]
                loads = [s.load for s in samples[key]]
                ratio = "baseline" if tool == "ddtree-ops" else f"{statistics.median(walls) / ours:.2f}x"
                print(f"| {count} | {workload} | {tool} | {spread(walls)} | {ratio} | "
                      f"{median(key, lambda s: s.client_cpu) * 1000:.0f} | {median(key, lambda s: s.host_cpu) * 1000:.0f} "
                      f"| {min(loads):.1f}-{max(loads):.1f} |")
            peers = {tool: median((count, workload, tool), lambda s: s.wall) for tool in PEERS}
            fastest = min(peers, key=peers.get)
            if count == 1:
                bound = 1.2 * peers["rsync"]
                verdicts.append(f"1 host, {workload}: push {ours * 1000:.0f} ms, rsync {peers['rsync'] * 1000:.0f} ms: "
                                f"{'met' if ours <= bound else 'MISSED'} (push within 1.2x of rsync)")
            else:
                verdicts.append(f"{count} hosts, {workload}: push {ours * 1000:.0f} ms, fastest peer {fastest} "
                                f"{peers[fastest] * 1000:.0f} ms: {'met' if ours <= peers[fastest] else 'MISSED'} "
                                "(push no slower than the fastest)")
    print()
    print("Targets (medians):")
    for line in verdicts:
        print(f"- {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=host_counts, default=[1, 8, 64], help="host counts, e.g. 1,8,64")
    parser.add_argument("--repeat", type=positive_int, default=3, help="interleaved rounds")
    parser.add_argument("--parallel", type=positive_int, default=32, help="hosts at once, for every tool")
    parser.add_argument("--login-user", help="log in to the loopback hosts as this existing account (root only)")
    parser.add_argument("--host-python", default=sys.executable, help="the hosts' `python:` (readable by that account)")
    parser.add_argument("--compare", metavar="PYTHON",
                        help="also time the ddtree-ops push beside this interpreter (another checkout's venv)")
    args = parser.parse_args()
    compared_cli(args.compare)  # a wrong path fails here, before the fleet starts
    missing = [t for t in ("rsync", "scp", "parallel-ssh", "tar") if not shutil.which(t)]
    if not sshd_available() or missing:
        raise SystemExit(f"needs sshd and ssh-keygen, rsync, scp, parallel-ssh, tar (missing: "
                         f"{', '.join(missing) or 'sshd'}): apt-get install openssh-server openssh-client rsync pssh")
    load_before = os.getloadavg()
    samples, files = run(args)
    report(samples, args, files, load_before)


if __name__ == "__main__":
    main()
