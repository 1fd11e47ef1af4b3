"""GPU check of the plugin's Prometheus series (run by scripts/device_check.sh): the tiny models
served on this GPU by DFlash + DDTree at budget 8 with --enable-metrics; /metrics, read with
the same parser `ddtree-ops status` uses, must equal the plugin's own counters (its
`DDTree metrics {json}` log lines, one per round), and the tree-build time (CUDA events) must be
there. The CPU server runs the same comparison in make test
(tests/sglang_server/test_metrics_and_status.py).

    python scripts/device_metrics_check.py MODELS_JSON LOG_DIR [--cpu]   (one JSON line; exit 1 on a mismatch)

--cpu serves with the CPU test server's arguments instead (its environment's python), to try
this script on a machine without a GPU.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddtree.sglang.round_metrics import JSON_PREFIX
from ddtree_ops.hostside.server_process import launch, stop_process_group, wait_until_serving
from ddtree_ops.live_metrics import parse_metrics

BUDGET = 8


def main(models_json: str, logs: str, cpu: bool = False) -> int:
    models = json.loads(Path(models_json).read_text().splitlines()[-1])
    prompts = [json.loads(line)["input_ids"] for line in Path(models["prompts"]).read_text().splitlines()]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", models["target"], "--skip-tokenizer-init",
            "--host", "127.0.0.1", "--port", str(port), "--page-size", "1", "--enable-metrics",
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", models["drafter"]]
    env = {**os.environ, "DDTREE_ENABLE": "1", "DDTREE_BUDGET": str(BUDGET), "DDTREE_METRICS_INTERVAL": "1"}
    if cpu:
        from ddtree.sglang.cpu.environment import SERVER_ARGS, SERVER_ENV

        argv += list(SERVER_ARGS)
        env.update(SERVER_ENV)
    log = Path(logs) / "sglang-metrics-server.log"
    process = launch(argv, env, log, port)
    try:
        wait_until_serving(process, port, 900, model_path=models["target"], log_path=log)

        def generate(ids: list[int]) -> None:
            body = json.dumps({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 32}})
            request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body.encode(),
                                             {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=600).read()

        for concurrency in (1, 4):
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(generate, prompts))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    finally:
        stop_process_group(process)
    (Path(logs) / "sglang-metrics.txt").write_text(text)
    live = parse_metrics("local", text)
    snapshots = [json.loads(line[line.index(JSON_PREFIX) + len(JSON_PREFIX):])
                 for line in log.read_text(errors="replace").splitlines() if JSON_PREFIX in line]
    expected = {"budget": BUDGET, "request_rounds": sum(s["requests"] for s in snapshots),
                "rounds": sum(s["rounds"] for s in snapshots),
                "branching_trees": sum(s["branching_trees"] for s in snapshots),
                "build_rounds": sum(s["timed_rounds"] for s in snapshots)}
    got = {name: getattr(live, name) for name in expected}
    ok = bool(snapshots) and got == expected and live.build_seconds > 0
    print(json.dumps({"ok": ok, "got": got, "expected": expected, "acceptance_length": live.acceptance_length,
                      "mean_build_ms": live.mean_build_ms}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], "--cpu" in sys.argv[3:]))
