"""How long `hosts list` takes, and how much memory, on large or deeply nested inventories.

    .venv/bin/python benchmarks/inventory_scale.py [--repeat 3] [--baseline-rev main]

Each figure is a whole `ddtree-ops hosts list` process (CLI start included, output to
/dev/null): wall time min / median / max over `--repeat` interleaved rounds, and the largest
peak RSS of the process (its rusage). Two baselines are measured in the same run: a one-host
inventory (the CLI's own floor), and, with `--baseline-rev REV` (default `main`; '' skips it),
the code of REV on the cases small enough for it (the quadratic host adding and unmemoised
group walk of the old code take minutes at 100k hosts or 23 diamond levels). The host's load
average before and after is printed under the table. Prints Markdown.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bench_args import positive_int  # noqa: E402  (benchmarks/, the script's folder)
from unit.test_ops_inventory_scale import chain_ini, diamond_ini  # noqa: E402  (the tests' own shapes)


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    expect: int = 0  # the exit code the current code gives
    old_too: bool = False  # small enough for the baseline revision


def cases() -> list[Case]:
    from ddtree_ops.ansible_inventory import MAX_GROUP_DEPTH

    return [
        Case("1 host (CLI floor)", "[g]\nh0\n", old_too=True),
        Case("range h[0:9999], 10k hosts", "[g]\nh[0:9999]\n", old_too=True),
        Case("range h[0:99999], 100k hosts", "[g]\nh[0:99999]\n"),
        Case(f"children chain of {MAX_GROUP_DEPTH} groups", chain_ini(MAX_GROUP_DEPTH), old_too=True),
        Case("children chain of 500 groups (exit 3)", chain_ini(500), expect=3),
        Case("diamond, 19 levels", diamond_ini(19), old_too=True),
        Case("diamond, 23 levels", diamond_ini(23)),
    ]


def run_once(argv: list[str], env: dict[str, str], cwd: Path, expect: int | None) -> tuple[float, int, int]:
    """(wall s, peak RSS KiB, exit code) of one process (run in `cwd`: `-m` puts the working
    folder first on sys.path, which must not be a checkout)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if expect is not None and code != expect:
        raise SystemExit(f"{' '.join(argv)}: exit {code}, expected {expect}\n{stderr.decode()[-2000:]}")
    return elapsed, usage.ru_maxrss, code


def old_tree(rev: str, into: Path) -> dict[str, str]:
    """REV's ddtree_ops and src/ from git (no worktree is registered), and the environment to run it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ddtree_ops", "src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return {**os.environ, "PYTHONPATH": f"{into}{os.pathsep}{into / 'src'}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--baseline-rev", default="main", help="git revision to measure beside ('' skips it)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch)
        variants = {"this tree": {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}}
        if args.baseline_rev:
            (base / "old").mkdir()
            variants[args.baseline_rev] = old_tree(args.baseline_rev, base / "old")
        files = {}
        for index, case in enumerate(cases()):
            files[case.name] = base / f"case{index}.ini"
            files[case.name].write_text(case.text)
        samples: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
        for _ in range(args.repeat):  # interleaved: a slow minute on the machine hits every row alike
            for case in cases():
                for variant, env in variants.items():
                    if variant != "this tree" and not case.old_too:
                        continue
                    argv = [sys.executable, "-m", "ddtree_ops", "hosts", "list", "-i", str(files[case.name])]
                    expect = case.expect if variant == "this tree" else 0
                    samples.setdefault((case.name, variant), []).append(run_once(argv, env, base, expect))
    print(f"| inventory | code | wall min / median / max (s) | peak RSS (MiB) | exit |")
    print("|---|---|---|---|---|")
    for (name, variant), runs in samples.items():
        walls = [r[0] for r in runs]
        print(f"| {name} | {variant} | {min(walls):.2f} / {statistics.median(walls):.2f} / {max(walls):.2f} "
              f"| {max(r[1] for r in runs) / 1024:.0f} | {sorted({r[2] for r in runs})} |")
    print(f"\n{args.repeat} rounds; load average before/after {load_before:.2f}/{os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs (other work on the machine inflates every figure)")


if __name__ == "__main__":
    main()
