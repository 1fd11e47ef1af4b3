"""The DDTree budget sweep inside the real SGLang server, on this machine's CPU (tiny models).

Runs what an operator would: `ddtree-ops smoke -H local --stages decode-bench,sglang-e2e` with
the local host's Python set to the CPU test server environment (scripts/sglang_cpu_env.sh) and
its `models:` the tiny pair (`python -m ddtree.sglang.cpu.tiny_models [--trained] DIR`), at
budgets 1, 4, 8, 16, 32, 64 (a budget below the drafter's block is served with a block of
budget + 1) and the given concurrency levels; then `ddtree-ops report RUN --plot DIR`, which
draws the server's acceptance and tokens/s against the budget beside the paper's curve
(baselines/ddtree-paper-budget-sweep.csv). Prints one row per variant: acceptance length in the
server, in the offline loop on the same prompts and in decode-bench; how many requests matched
the offline loop exactly / with a named near-tie / not; tokens/s per concurrency level and the
speedup over no speculation at that level; the host's load before and after. CPU numbers:
SGLang's CPU engine on 2 cores, never GPU speed; compare budgets with each other, not with the
paper's absolute values.

Usage: .venv/bin/python benchmarks/sglang_budget_sweep.py [--pair trained|random | --models MODELS.json]
       [--budgets 1,4,8,16,32,64] [--concurrency 1,4] [--tokens 48] [--requests-per-level 8] [--out DIR]
About 8 servers of 20-60 s each on 2 idle cores, plus the requests: 10-20 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_args import budget_list, positive_int  # noqa: E402

PAIR_ARGS = {"random": [], "trained": ["--trained"]}


def cpu_env_python() -> Path:
    done = subprocess.run(["bash", str(REPO / "scripts" / "sglang_cpu_env.sh")], capture_output=True, text=True,
                          check=True)
    python = Path(done.stdout.strip().splitlines()[-1])
    return python if python.is_absolute() else REPO / python


def write_models(python: Path, pair: str, folder: Path) -> dict:
    from ddtree.sglang.cpu.environment import SERVER_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "SGLANG_"))} | SERVER_ENV
    done = subprocess.run([str(python), "-m", "ddtree.sglang.cpu.tiny_models", *PAIR_ARGS[pair], str(folder)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port_block(size: int) -> int:
    """A base port whose next `size` ports were free a moment ago (the stage checks each again)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size < 65535 and all(_free(base + i) for i in range(size)):
            return base
    raise SystemExit("no block of free ports found")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def ddtree_ops(*args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", *args, "--json"], capture_output=True, text=True)
    try:
        return done.returncode, json.loads(done.stdout)
    except json.JSONDecodeError:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"ddtree-ops {args[0]} printed no JSON (exit {done.returncode})")


def table(report: dict, levels: list[int]) -> list[str]:
    loads = {(r["variant"], r["concurrency"]): r for r in report["server_load"]}
    decode = {r["method"]: r for r in report["decode"]}
    header = (f"{'variant':<12} {'block':>5} {'server tau':>10} {'offline':>8} {'bench':>6} {'req =/~/x':>10} "
              + " ".join(f"{f'tok/s @{c}':>10} {'vs no-spec':>10}" for c in levels))
    lines = [header, "-" * len(header)]

    def num(value, width, digits=3):
        return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    for row in report["server"]:
        counts = "/".join(str(row.get(k, "-")) for k in ("acceptance_equal", "acceptance_near_tie", "acceptance_mismatch"))
        bench = decode.get(row.get("method") or "", {}).get("tau") if row.get("block_size") is None else None
        cells = []
        for level in levels:
            load = loads.get((row["variant"], level), {})
            cells.append(f"{num(load.get('tokens_per_s'), 10, 1)} {num(load.get('speedup_vs_no_spec'), 10, 2)}")
        lines.append(f"{row['variant']:<12} {str(row.get('block_size') or '-'):>5} {num(row.get('acceptance_length'), 10)} "
                     f"{num(row.get('offline_acceptance_length'), 8)} {num(bench, 6)} "
                     f"{counts if row.get('method') else '-':>10} " + " ".join(cells))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIR_ARGS), default="trained")
    parser.add_argument("--models", type=Path, help="a `models:` entry as JSON (what tiny_models prints) to "
                        "serve instead of writing the pair")
    parser.add_argument("--budgets", type=budget_list, default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--concurrency", type=budget_list, default=[1, 4])
    parser.add_argument("--tokens", type=positive_int, default=48)
    parser.add_argument("--requests-per-level", type=positive_int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / ".cache" / "bench-sglang-budget-sweep")
    args = parser.parse_args()
    if any(b < 1 for b in args.budgets) or any(c < 1 for c in args.concurrency):
        parser.error("budgets and concurrency levels are integers >= 1")

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = cpu_env_python()
    models = json.loads(args.models.read_text()) if args.models else \
        write_models(python, args.pair, out / f"models-{args.pair}")
    inventory = out / "hosts.yaml"
    inventory.write_text(json.dumps({"hosts": {"local": {
        "transport": "local", "workdir": str(out / "wd"), "python": str(python), "models": models}}}))
    budgets = ",".join(str(b) for b in args.budgets)
    levels = ",".join(str(c) for c in args.concurrency)
    load_before = os.getloadavg()
    began = time.monotonic()
    code, smoke = ddtree_ops(
        "smoke", "-i", str(inventory), "--runs-dir", str(out / "runs"), "-H", "local",
        "--stage-timeout", "7200",  # eight servers one after another: 10 minutes is too short on a busy machine
        "--stages", "decode-bench,sglang-e2e", "--budgets", budgets, "--set", f"sglang_budgets=[{budgets}]",
        "--set", f"sglang_concurrency=[{levels}]", "--set", f"sglang_requests_per_level={args.requests_per_level}",
        "--set", f"max_new_tokens={args.tokens}", "--set", f"sglang_max_new_tokens={args.tokens}",
        "--set", "sglang_start_timeout_s=900", "--set", f"sglang_port={free_port_block(len(args.budgets) + 2)}")
    wall = time.monotonic() - began
    load_after = os.getloadavg()
    _, report = ddtree_ops("report", smoke["run_id"], "--runs-dir", str(out / "runs"), "--plot", str(out / "plots"))
    pair = args.models or f"{args.pair} tiny pair"
    print(f"# SGLang CPU server, {pair} (block {models['block_size']}), {args.tokens} new tokens, "
          f"T=0 · CPU numbers (SGLang's CPU engine), not GPU speed")
    print(f"# smoke exit {code} in {wall:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"on {os.cpu_count()} CPUs; run {smoke['run_id']}")
    for line in table(report, args.concurrency):
        print(line)
    for failure in smoke.get("failures", []):
        print(f"# FAIL {failure}")
    for path in report.get("plots", []):
        print(f"# chart: {path}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
