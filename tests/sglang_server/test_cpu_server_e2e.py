"""The plugin serving inside the real sglang 0.5.23 server, on CPU: no speculation, DFlash
(linear verify) and DFlash with the DDTree plugin at budgets 1, 8 and 32 give the same
tokens at temperature 0, one request at a time and four at once, and the plugin's own
counters show that it verified trees wider than one path.

Everything SGLang runs here is its own code (scheduler, DFlash worker, KV pools, eagle_sample)
except what docs/dev/sglang-ddtree-roadmap.md lists for the CPU server (ddtree.sglang.cpu).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cpu_server import (
    cpu_env_python,
    launch_argv,
    metrics_snapshots,
    running_server,
    server_env,
    write_models,
)

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 24
CONCURRENCY = (1, 4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    python = cpu_env_python()
    folder = tmp_path_factory.mktemp("cpu-server")
    models = write_models(python, folder / "models")
    prompts = [json.loads(line)["input_ids"] for line in Path(models["prompts"]).read_text().splitlines()]
    assert len(prompts) >= 8
    return python, models, prompts, folder


def serve_and_generate(setup, name: str, *, speculative: bool, block_size: int | None = None,
                       env: dict[str, str] | None = None) -> tuple[dict[int, list[list[int]]], str]:
    python, models, prompts, folder = setup
    outputs = {}
    with running_server(lambda port: launch_argv(python, models, port, speculative=speculative, block_size=block_size),
                        folder / f"{name}.log", server_env(env)) as server:
        for concurrency in CONCURRENCY:
            outputs[concurrency] = server.generate_all(prompts, MAX_NEW_TOKENS, concurrency)
        log = server.log_text()
    return outputs, log


@pytest.fixture(scope="module")
def reference(setup):
    outputs, _ = serve_and_generate(setup, "no-spec", speculative=False)
    assert outputs[1] == outputs[4], "no speculation: batching changed the greedy tokens"
    assert all(len(o) == MAX_NEW_TOKENS for o in outputs[1])
    assert len({tuple(o) for o in outputs[1]}) == len(outputs[1]), "prompts should not all decode alike"
    return outputs[1]


def assert_same_tokens(outputs: dict[int, list[list[int]]], reference: list[list[int]], what: str) -> None:
    for concurrency, got in outputs.items():
        for index, (expected, actual) in enumerate(zip(reference, got)):
            assert actual == expected, f"{what}, concurrency {concurrency}, prompt {index}: {actual} != {expected}"


def test_dflash_linear_matches_no_speculation(setup, reference):
    outputs, log = serve_and_generate(setup, "dflash", speculative=True, env={"DDTREE_ENABLE": "0"})
    assert "DDTree worker ready" not in log
    assert_same_tokens(outputs, reference, "DFlash")


@pytest.mark.parametrize(("budget", "block_size"), [(1, 2), (8, None), (32, None)])
def test_ddtree_plugin_matches_no_speculation(setup, reference, budget, block_size):
    env = {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": str(budget), "DDTREE_STRICT": "1", "DDTREE_METRICS_INTERVAL": "1"}
    outputs, log = serve_and_generate(setup, f"ddtree-b{budget}", speculative=True, block_size=block_size, env=env)
    assert f"budget {budget}, verify width {budget + 1}" in log, "the DDTree worker did not start"
    assert_same_tokens(outputs, reference, f"DDTree budget {budget}")
    snapshots = metrics_snapshots(log)
    rounds = sum(s["rounds"] for s in snapshots)
    branching = sum(s["branching_trees"] for s in snapshots)
    assert rounds > 0, "the plugin verified no tree"
    assert all(s["mean_tree_size"] <= budget + 1 for s in snapshots)
    if budget == 1:
        assert branching == 0  # one node cannot branch
    else:
        assert branching > 0, f"budget {budget}: no tree wider than one path was verified"
        assert max(s["mean_tree_size"] for s in snapshots) > 1 + 5  # deeper than the drafter's block alone
