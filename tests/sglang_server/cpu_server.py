"""The CPU test server: its environment (scripts/sglang_cpu_env.sh, built once and cached
under <repo>/.cache), tiny models, and real `python -m sglang.launch_server` processes on
127.0.0.1 that are always stopped (their whole process group).

Tests that use it are slow (a server start is 10-30 s on 2 cores) and need no network
beyond the package registry the first build installs from.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ddtree_ops.hostside.server_process import PortTakenError, launch, stop_process_group, wait_until_serving

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DDTREE_TEST_CACHE", REPO / ".cache"))
START_TIMEOUT_S = 600  # a cold start beside busy loops; a warm idle one takes 10-20 s
REQUEST_TIMEOUT_S = 600
PORT_TRIES = 3  # a free port another process takes before our server binds it: start again elsewhere


def cpu_env_python() -> Path:
    """The CPU server environment's python (built on first use, under a lock for xdist)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "sglang-cpu-env.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(["bash", str(REPO / "scripts" / "sglang_cpu_env.sh")], capture_output=True,
                              text=True, env={**os.environ, "SGLANG_CPU_VENV": str(CACHE / "sglang-cpu-venv")})
    if done.returncode != 0:
        raise RuntimeError(f"scripts/sglang_cpu_env.sh failed: {done.stderr.strip()[-1500:]}")
    python = Path(done.stdout.strip().splitlines()[-1])
    return python if python.is_absolute() else REPO / python


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    from ddtree.sglang.cpu.environment import SERVER_ENV

    ours = ("DDTREE_", "SGLANG_", "PYTHONPATH", "CPU_TEST_SERVER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env.update(SERVER_ENV)
    env.update(extra or {})
    return env


def run_in_env(python: Path, script: Path, *args: str, timeout: float = 600) -> Any:
    """Run a script in the CPU environment (CPU engine on); returns the JSON of its last line."""
    done = subprocess.run([str(python), str(script), *args], capture_output=True, text=True,
                          env=server_env(), cwd=str(REPO), timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{script.name} exited {done.returncode}: {done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_models(python: Path, folder: Path, *, trained: bool = False) -> dict[str, Any]:
    """The tiny models' `models:` entry: the random pair, or the trained one (committed weights:
    a copy; ddtree.sglang.cpu.trained_pair)."""
    flags = ["--trained"] if trained else []
    done = subprocess.run([str(python), "-m", "ddtree.sglang.cpu.tiny_models", *flags, str(folder)],
                          capture_output=True, text=True, env=server_env(), timeout=3600)
    if done.returncode != 0:
        raise AssertionError(f"tiny_models failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tiny_pair(folder: Path) -> tuple[Path, dict[str, Any], list[list[int]]]:
    """(the CPU environment's python, the tiny models written under `folder`, their prompts as token ids)."""
    python = cpu_env_python()
    models = write_models(python, folder / "models")
    prompts = [json.loads(line)["input_ids"] for line in Path(models["prompts"]).read_text().splitlines()]
    return python, models, prompts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, port: int, log: Path, process: subprocess.Popen):
        self.port, self.log, self.process = port, log, process

    def generate(self, input_ids: list[int], max_new_tokens: int, top2: bool = False) -> dict[str, Any]:
        """One request at T=0; ignore_eos: exactly max_new_tokens, as the offline loop makes;
        `top2`: with the top-2 log-probs of every output position (meta_info.output_top_logprobs)."""
        sampling = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new_tokens}
        payload = {"input_ids": input_ids, "sampling_params": sampling}
        if top2:
            payload.update(return_logprob=True, top_logprobs_num=2)
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def generate_all(self, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                     top2: bool = False) -> list[dict[str, Any]]:
        """One request per prompt, `concurrency` in flight; replies in prompt order."""
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(lambda ids: self.generate(ids, max_new_tokens, top2), prompts))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def launch_argv(python: Path, models: dict[str, Any], port: int, *, speculative: bool,
                block_size: int | None = None) -> list[str]:
    from ddtree.sglang.cpu.environment import SERVER_ARGS

    argv = [str(python), "-m", "sglang.launch_server", "--model-path", models["target"], "--skip-tokenizer-init",
            "--host", "127.0.0.1", "--port", str(port), "--page-size", "1", *SERVER_ARGS]
    if speculative:
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", models["drafter"]]
        if block_size is not None:
            argv += ["--speculative-dflash-block-size", str(block_size)]
    return argv


def output_ids(reply: dict[str, Any]) -> list[int]:
    return [int(t) for t in reply["output_ids"]]


def start_server(argv_without_port: Any, log: Path, env: dict[str, str]) -> Server:
    """A server on a free port that is ours once it answers (server_process: its socket, and the
    model path of its argv in /server_info); a port taken by another process meanwhile fails
    that start at once, and the next try takes another port."""
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        argv = argv_without_port(port)
        model_path = argv[argv.index("--model-path") + 1]
        process = launch(argv, env, log, port)
        server = Server(port, log, process)
        try:
            wait_until_serving(process, port, START_TIMEOUT_S, model_path=model_path, log_path=log)
            return server
        except PortTakenError:
            stop_process_group(process)
            if attempt == PORT_TRIES:
                raise
        except (RuntimeError, TimeoutError) as err:
            stop_process_group(process)
            raise AssertionError(f"{err}:\n{server.log_text()[-3000:]}") from err
    raise AssertionError("unreachable")


@contextmanager
def running_server(argv_without_port: Any, log: Path, env: dict[str, str]) -> Iterator[Server]:
    server = start_server(argv_without_port, log, env)
    try:
        yield server
    finally:
        stop_process_group(server.process)


def metrics_snapshots(log_text: str) -> list[dict[str, Any]]:
    """The plugin's `DDTree metrics {json}` lines (ddtree.sglang.round_metrics.JSON_PREFIX)."""
    from ddtree.sglang.round_metrics import JSON_PREFIX

    found = []
    for line in log_text.splitlines():
        at = line.find(JSON_PREFIX)
        if at >= 0:
            found.append(json.loads(line[at + len(JSON_PREFIX):]))
    return found
