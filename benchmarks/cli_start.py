"""How long `ddtree-ops` takes to start: `--help`, `--version`, every verb's `--help` (the verb's module
and everything the CLI needs to parse its options; what the verb then does is its own work), and
`hosts list -i FILE` (options given as words, and an 8-host inventory read and checked).

    .venv/bin/python benchmarks/cli_start.py [--repeat 15] [--imports 5] [--target 0.12]
    .venv/bin/python benchmarks/cli_start.py --compare /path/to/other-checkout/.venv/bin/python

Every command runs once untimed first, its bytecode kept as an installed package's is
(benchmarks/bytecode.py). `--compare PYTHON` times that interpreter's `ddtree-ops` (another
checkout's, say `main`) in the same rounds, for a ratio measured under the same load. Each
figure is a whole `ddtree-ops` process (interpreter start included), in interleaved rounds:
wall time and the process's CPU time (user + system, from its rusage), min / median / max. The
CPU time and the minimum suffer least from other work on the machine; the load average is
printed with them. A second table lists the modules whose imports cost the most during
`ddtree-ops --help` (`python -X importtime`, the smallest figure of `--imports` runs), and
whether any module a `--help` must not load (torch, paramiko, Rich's help and markup
machinery) was loaded.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_args import positive_int  # noqa: E402
from bytecode import bytecode_env  # noqa: E402

CLI = str(Path(sys.executable).with_name("ddtree-ops"))


def verbs() -> list[str]:
    """Every command of this checkout's CLI (`hosts list`, ...), as the CLI itself lists them: a verb
    added later is timed too."""
    import typer

    from ddtree_ops.cli.app import app, prepare

    prepare()
    found, todo = [], [([], typer.main.get_command(app))]
    while todo:
        path, command = todo.pop(0)
        for name, sub in getattr(command, "commands", {}).items():
            if hasattr(sub, "commands"):
                todo.append(([*path, name], sub))
            else:
                found.append(" ".join([*path, name]))
    return found

# What `--help` must not import (the test in tests/unit/test_ops_layering.py keeps it so).
HEAVY = ("torch", "paramiko", "typer.rich_utils", "rich.markdown", "rich.syntax", "rich.traceback", "pygments",
         "markdown_it", "pydantic", "yaml")


ENV = bytecode_env()


FLEET_HOSTS = 8


def fleet_inventory() -> str:
    """A hosts.yaml as an operator writes one (placeholder names), for a verb that reads it and
    does nothing else: `hosts list` is option parsing plus the inventory, the start of every verb."""
    folder = tempfile.mkdtemp(prefix="ddtree-cli-start-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = Path(folder) / "hosts.yaml"
    hosts = "".join(f"  gpu-{i}:\n    hostname: gpu-{i}.example.invalid\n    groups: [eval]\n" for i in range(FLEET_HOSTS))
    path.write_text("defaults:\n  user: ops\n  python: /opt/venv/bin/python\n  connect_timeout: 10\n"
                    f"  models: {{target: /models/target, drafter: /models/drafter}}\nhosts:\n{hosts}")
    return str(path)


def one_run(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one process."""
    import time

    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {os.waitstatus_to_exitcode(status)}\n{stderr.decode()[-2000:]}")
    return elapsed, usage.ru_utime + usage.ru_stime


def import_costs(runs: int) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """{module: (self µs, cumulative µs)}, the smallest of `runs` runs of `ddtree-ops --help`, and
    the heavy modules it loaded."""
    best: dict[str, tuple[int, int]] = {}
    loaded: set[str] = set()
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddtree_ops", "--help"],
                              capture_output=True, text=True, check=True, env=ENV)
        for line in done.stderr.splitlines():
            if not line.startswith("import time:") or "|" not in line or "self [us]" in line:
                continue
            own, total, name = line[len("import time:"):].split("|")
            module = name.strip()
            cost = (int(own), int(total))
            best[module] = min(best.get(module, cost), cost)
            if module.split(".")[0] in HEAVY or module in HEAVY:
                loaded.add(module)
    return best, loaded


def spread(values: list[float]) -> str:
    return f"{min(values) * 1000:.0f} / {statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=positive_int, default=15, help="interleaved rounds")
    parser.add_argument("--imports", type=positive_int, default=5, help="-X importtime runs (smallest kept)")
    parser.add_argument("--target", type=float, default=0.12, help="seconds a start should take at most")
    parser.add_argument("--compare", metavar="PYTHON",
                        help="also time the ddtree-ops beside this interpreter (another checkout's venv)")
    args = parser.parse_args()
    clis = [("", CLI)]
    if args.compare:
        other = Path(args.compare).with_name("ddtree-ops")
        if not other.is_file():
            parser.error(f"--compare: no ddtree-ops beside {args.compare}")
        clis.append((f"[{args.compare}] ", str(other)))
    inventory = fleet_inventory()
    commands = [(f"{tag}ddtree-ops {' '.join(words)}".rstrip(), [cli, *words])
                for words in [["--help"], ["--version"]] + [[*verb.split(), "--help"] for verb in verbs()]
                for tag, cli in clis]
    commands += [(f"{tag}ddtree-ops hosts list -i <{FLEET_HOSTS}-host hosts.yaml>", [cli, "hosts", "list", "-i", inventory])
                 for tag, cli in clis]
    baseline = ("python -c pass (the interpreter alone)", [sys.executable, "-c", "pass"])
    for _, argv in [baseline, *commands]:
        one_run(argv)  # untimed: writes the bytecode the timed runs read
    load_before = os.getloadavg()
    samples: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.repeat):  # interleaved: load from other work hits every row alike
        for name, argv in [baseline, *commands]:
            samples.setdefault(name, []).append(one_run(argv))
    costs, heavy = import_costs(args.imports)
    load_after = os.getloadavg()
    print(f"ddtree-ops start: {args.repeat} interleaved rounds, python {sys.version.split()[0]}, {os.cpu_count()} cores, "
          f"load average (1/5/15 min) before {'/'.join(f'{v:.1f}' for v in load_before)}, after "
          f"{'/'.join(f'{v:.1f}' for v in load_after)} (other work inflates every figure; the minimum least)")
    print()
    print(f"| command | wall ms min / median / max | CPU ms min / median / max | median wall under {args.target:g} s |")
    print("|---|---|---|---|")
    for name, _ in [baseline, *commands]:
        walls, cpus = [s[0] for s in samples[name]], [s[1] for s in samples[name]]
        if name == baseline[0]:
            verdict = "-"
        elif name.startswith("["):  # the compared checkout: its median against this one's, same rounds
            ours = [s[0] for s in samples[name.split("] ", 1)[1]]]
            verdict = f"{statistics.median(walls) / statistics.median(ours):.2f}x this checkout's"
        else:
            verdict = "met" if statistics.median(walls) < args.target else "MISSED"
        print(f"| {name} | {spread(walls)} | {spread(cpus)} | {verdict} |")
    print()
    print(f"Costliest imports of `ddtree-ops --help` (smallest of {args.imports} `-X importtime` runs, ms):")
    print()
    print("| module | self | with what it imports |")
    print("|---|---:|---:|")
    for module, (own, total) in sorted(costs.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {module} | {own / 1000:.1f} | {total / 1000:.1f} |")
    print()
    print(f"modules a `--help` must not load, loaded: {', '.join(sorted(heavy)) or 'none'}")


if __name__ == "__main__":
    main()
