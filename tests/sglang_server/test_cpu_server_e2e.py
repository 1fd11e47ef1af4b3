"""The plugin serving the trained tiny pair (models/trained-pair) inside the real sglang 0.5.23
server, on CPU: no speculation, DFlash (linear verify) and DFlash with the DDTree plugin at
budgets 1, 16 and 32 give the same tokens at temperature 0, one request at a time and four at
once; the NeoX drafter runs through the fused-RoPE stand-in (ddtree.sglang.cpu.fused_rope); the
plugin's counters show that it verified trees wider than one path; DDTree accepts more than
DFlash's chain at budgets 16 and 32; and every request's acceptance, as SGLang counts it per
request (meta_info.spec_correct_drafts_histogram), is the offline loop's on the same prompt,
method, budget and block (exact where the offline target had no near-tie at a position a round
committed; ddtree_ops.hostside.acceptance). Each server starts once for the module. A DDTree
verify stripped of its tree mask on purpose (CPU_TEST_SERVER_FAULT) stops the server.

Everything SGLang runs here is its own code (scheduler, DFlash worker, KV pools, eagle_sample)
except what docs/dev/sglang-ddtree-roadmap.md lists for the CPU server (ddtree.sglang.cpu).
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
from http.client import HTTPException
from pathlib import Path

import pytest

from ddtree_ops.hostside import acceptance
from ddtree_ops.hostside.offline_acceptance import OfflineLoop, OfflineMethod, run_offline
from ddtree_ops.hostside.server_process import PortTakenError, launch, stop_process_group, wait_until_serving
from ddtree_ops.hostside.stages.sglang_e2e import ServerMode, plan_variants, server_top2

from .cpu_server import (
    cpu_env_python,
    launch_argv,
    metrics_snapshots,
    output_ids,
    running_server,
    server_env,
    write_models,
)

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 16  # short requests: CI time (each server serves 16 of them)
PROMPTS = 8
CONCURRENCY = (1, 4)
BUDGETS = (1, 16, 32)
SPECULATIVE = ("dflash",) + tuple(f"ddtree-b{b}" for b in BUDGETS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    python = cpu_env_python()
    folder = tmp_path_factory.mktemp("cpu-server")
    models = write_models(python, folder / "models", trained=True)
    prompts = [json.loads(line)["input_ids"] for line in Path(models["prompts"]).read_text().splitlines()][:PROMPTS]
    assert len(prompts) == PROMPTS
    variants = {v.name: v for v in plan_variants(list(BUDGETS), int(models["block_size"]))}
    return python, models, prompts, folder, variants


def serve_and_generate(setup, name: str) -> tuple[dict[int, list[dict]], str]:
    """Replies per concurrency level from the variant's server, and its log."""
    python, models, prompts, folder, variants = setup
    variant = variants[name]
    env = dict(variant.env())
    if variant.mode is ServerMode.DDTREE:
        env["DDTREE_METRICS_INTERVAL"] = "1"
    speculative = variant.mode is not ServerMode.NO_SPEC
    replies = {}
    with running_server(lambda port: launch_argv(python, models, port, speculative=speculative,
                                                 block_size=variant.block_size),
                        folder / f"{name}.log", server_env(env)) as server:
        for concurrency in CONCURRENCY:  # no speculation: with its top-2, to measure the margin
            replies[concurrency] = server.generate_all(prompts, MAX_NEW_TOKENS, concurrency, top2=not speculative)
        log = server.log_text()
    return replies, log


@pytest.fixture(scope="module")
def served(setup):
    """name -> (replies per concurrency, log); each server is started on first use only."""
    cache: dict[str, tuple[dict[int, list[dict]], str]] = {}

    def get(name: str) -> tuple[dict[int, list[dict]], str]:
        if name not in cache:
            cache[name] = serve_and_generate(setup, name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference(served):
    replies, _ = served("no-spec")
    outputs = {c: [output_ids(r) for r in found] for c, found in replies.items()}
    assert outputs[1] == outputs[4], "no speculation: batching changed the greedy tokens"
    assert all(len(o) == MAX_NEW_TOKENS for o in outputs[1])
    assert len({tuple(o) for o in outputs[1]}) == len(outputs[1]), "prompts should not all decode alike"
    return outputs[1]


@pytest.fixture(scope="module")
def offline(setup, served):
    """name -> the offline loop (float32, ddtree.decode, margins kept) on that variant's method,
    budget and block, following its server's own tokens; each decoded on first use only."""
    _, models, prompts, _, variants = setup
    cache: dict[str, list] = {}

    def get(name: str) -> list:
        if name not in cache:
            replies, _ = served(name)
            method = OfflineMethod(name, variants[name].budget, variants[name].block_size)
            cache[name] = run_offline(models, prompts, [method], MAX_NEW_TOKENS, "cpu",
                                      texts={name: [output_ids(r) for r in replies[1]]})[name]
        return cache[name]

    return get


@pytest.fixture(scope="module")
def margin(setup, served):
    """The near-tie margin as the stage measures it: twice the largest difference between the
    no-speculation server's top-2 gaps and the offline target's on the same text."""
    _, models, prompts, _, _ = setup
    replies, _ = served("no-spec")
    loop = OfflineLoop(models, "cpu")
    try:
        noise = loop.margin_noise(prompts, [output_ids(r) for r in replies[1]],
                                  [server_top2(r["meta_info"]) for r in replies[1]]).summary()
    finally:
        loop.close()
    assert noise["positions"] == len(prompts) * MAX_NEW_TOKENS, noise
    return acceptance.auto_margin(noise["max"])


def assert_same_tokens(replies: dict[int, list[dict]], reference: list[list[int]], what: str) -> None:
    for concurrency, found in replies.items():
        for index, (expected, reply) in enumerate(zip(reference, found)):
            assert output_ids(reply) == expected, f"{what}, concurrency {concurrency}, prompt {index}"


def test_dflash_linear_matches_no_speculation(served, reference):
    replies, log = served("dflash")
    assert "DDTree worker ready" not in log
    assert_same_tokens(replies, reference, "DFlash")


@pytest.mark.parametrize("budget", BUDGETS)
def test_ddtree_plugin_matches_no_speculation(setup, served, reference, budget):
    replies, log = served(f"ddtree-b{budget}")
    assert f"budget {budget}, verify width {budget + 1}" in log, "the DDTree worker did not start"
    assert "fused QK-norm + RoPE runs in torch" in log, "the NeoX drafter did not reach the RoPE stand-in"
    assert_same_tokens(replies, reference, f"DDTree budget {budget}")
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


@pytest.mark.parametrize("name", SPECULATIVE)
def test_each_requests_acceptance_is_the_offline_loops(served, offline, margin, name):
    """Per request, one at a time and four at once: SGLang's per-request histogram against the
    offline loop's, exact unless a near-tie is named; the variant's mean within tolerance."""
    replies, _ = served(name)
    for concurrency, found in replies.items():
        checks = [acceptance.check_request(i, output_ids(r), acceptance.server_histogram(r["meta_info"]),
                                           offline(name)[i], margin)
                  for i, r in enumerate(found)]
        variant = acceptance.VariantCheck(name, checks, acceptance.DEFAULT_ACCEPTANCE_TOLERANCE)
        assert not variant.problems, f"concurrency {concurrency}: {variant.problems}"
        summary = variant.summary()
        assert summary["rounds_held_exactly"] > 0, f"{name} at {concurrency}: nothing was held exactly ({summary})"
        for check in checks:
            if check.verdict == acceptance.Verdict.EQUAL:
                assert check.server == check.offline and acceptance.rounds_of(check.server) > 0


def test_ddtree_accepts_more_than_dflash_at_budgets_16_and_32(served):
    """Acceptance length over every request and round, DDTree against DFlash's chain: strictly
    more (the trained pair; a random pair accepts about one token a round either way)."""
    def tau(name: str) -> float:
        replies, _ = served(name)
        counts = [acceptance.server_histogram(r["meta_info"]) for r in replies[1]]
        return acceptance.mean_length(acceptance.add_histograms(counts))

    dflash = tau("dflash")
    gains = {budget: tau(f"ddtree-b{budget}") / dflash for budget in (16, 32)}
    assert dflash > 1.5, dflash  # the drafter is a trained one
    assert all(g > 1.0 for g in gains.values()), (dflash, gains)


def test_a_port_taken_while_the_server_starts_fails_the_start_at_once(setup, tmp_path):
    """SGLang binds its port only after loading the model: a process that takes the port in
    between fails our start within seconds, naming the port and the holder, and whatever it
    answers is never measured."""
    python, models, _, _, _ = setup
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = launch(launch_argv(python, models, port, speculative=False), server_env(), tmp_path / "s.log", port)
    try:
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            began = time.monotonic()
            with pytest.raises(PortTakenError, match=f"port {port} was taken by pid "):
                wait_until_serving(process, port, 600, model_path=models["target"], log_path=tmp_path / "s.log")
            assert time.monotonic() - began < 60
    finally:
        stop_process_group(process)
    assert process.poll() is not None


def test_a_ddtree_verify_without_its_tree_mask_stops_the_cpu_server(setup):
    """SGLang's own warm-up request is the first DDTree round: the server stops there, before it
    reports healthy (or, had it come up, on the first request), naming the fault."""
    python, models, prompts, folder, _ = setup
    env = {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "16", "CPU_TEST_SERVER_FAULT": "verify-without-tree-mask"}
    log = folder / "mask-fault.log"
    with pytest.raises((AssertionError, urllib.error.URLError, HTTPException, ConnectionError)) as stopped:
        with running_server(lambda port: launch_argv(python, models, port, speculative=True), log,
                            server_env(env)) as server:
            server.generate(prompts[0], MAX_NEW_TOKENS)  # served: the fault went unnoticed
    assert not isinstance(stopped.value, AssertionError) or "before answering" in str(stopped.value), stopped.value
    text = log.read_text(errors="replace")
    assert "fault verify-without-tree-mask injected" in text
    assert "MissingTreeMaskError: ddtree_cpu: a target-verify batch (17 tokens per request, layer 0) arrived " \
           "without a tree mask while the DDTree plugin is enabled" in text, text[-3000:]
