"""DDTree observed in a real sglang 0.5.23 server on CPU, one server shared by every test here
(a server start is the suite's most expensive step): DFlash + DDTree at budget 8 with
`--enable-metrics`, driven with the tiny models' prompts.

- `/metrics` carries the plugin's series next to SGLang's own, read with prometheus_client's
  text parser, each value equal to the plugin's own counters (its `DDTree metrics {json}` log
  lines, one per round here: DDTREE_METRICS_INTERVAL=1);
- `ddtree-ops status` over the sshd fleet, the server behind one host: the live acceptance
  read on that host's loopback, beside the host's latest passing `sglang-e2e`, and a host with
  no server saying so.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.sglang import prometheus_export as px

from .cpu_server import launch_argv, metrics_snapshots, running_server, server_env, tiny_pair

pytestmark = pytest.mark.slow

BUDGET = 8
MAX_NEW_TOKENS = 24
CONCURRENCY = (1, 4)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, its models, its log text after the traffic): the server stays up for the module."""
    folder = tmp_path_factory.mktemp("metrics-server")
    python, models, prompts = tiny_pair(folder)
    env = server_env({"DDTREE_ENABLE": "1", "DDTREE_BUDGET": str(BUDGET), "DDTREE_STRICT": "1",
                      "DDTREE_METRICS_INTERVAL": "1"})
    argv = lambda port: [*launch_argv(python, models, port, speculative=True), "--enable-metrics"]  # noqa: E731
    with running_server(argv, folder / "server.log", env) as server:
        for concurrency in CONCURRENCY:
            server.generate_all(prompts, MAX_NEW_TOKENS, concurrency)
        yield server, models, python


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        return reply.read().decode()


def test_metrics_endpoint_carries_the_plugins_counters_next_to_sglangs(served):
    server, models, _ = served
    text = scrape(server.port)
    snapshots = metrics_snapshots(server.log_text())  # read after the scrape: it can only have more
    assert snapshots, "the plugin logged no metrics"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "sglang:gen_throughput" in families and "sglang:num_requests" in families  # SGLang's own, same endpoint
    labels = {"model_name": models["target"], "budget": str(BUDGET)}

    def value(sample_name: str, **extra: str) -> float:
        family = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum").removesuffix("_bucket")
        found = [s.value for s in families[family].samples if s.name == sample_name and s.labels == {**labels, **extra}]
        assert len(found) == 1, (sample_name, extra, families[family].samples)
        return found[0]

    histogram = [sum(s["acceptance_histogram"][length] if length < len(s["acceptance_histogram"]) else 0
                     for s in snapshots) for length in range(max(len(s["acceptance_histogram"]) for s in snapshots))]
    requests = sum(s["requests"] for s in snapshots)
    assert sum(histogram) == requests > 0
    assert value(px.ACCEPTANCE_LENGTH + "_count") == requests
    assert value(px.ACCEPTANCE_LENGTH + "_sum") == sum(length * n for length, n in enumerate(histogram))
    for length in range(1, len(histogram)):
        assert value(px.ACCEPTANCE_LENGTH + "_bucket", le=f"{float(length)}") == sum(histogram[: length + 1])
    assert value(px.TREE_TOKENS + "_total") == sum(s["tree_tokens"] for s in snapshots)
    assert value(px.BRANCHING_TREES + "_total") == sum(s["branching_trees"] for s in snapshots) > 0
    assert value(px.ROUNDS + "_total") == sum(s["rounds"] for s in snapshots)
    assert value(px.TREE_BUILD_SECONDS + "_count") == sum(s["timed_rounds"] for s in snapshots) > 0
    assert value(px.TREE_BUILD_SECONDS + "_sum") == pytest.approx(sum(s["build_ms_total"] for s in snapshots) / 1e3,
                                                                  rel=1e-9)
    assert value(px.BUDGET) == BUDGET


@pytest.mark.sshd
def test_status_reads_the_live_acceptance_over_ssh_and_holds_it_against_the_hosts_reference(
        served, sshd_fleet, tmp_path, capsys):
    from ddtree_ops.cli.app import main
    from fixtures.e2e_runs import e2e_row, write_e2e_run
    from sshd_fleet import free_port

    server, _, python = served
    snapshots = metrics_snapshots(server.log_text())
    requests = sum(s["requests"] for s in snapshots)
    accepted = sum(length * n for s in snapshots for length, n in enumerate(s["acceptance_histogram"]))
    live = accepted / requests  # the plugin's own figure, from its log lines
    silent = free_port()
    fleet = sshd_fleet(2)  # h0 serves (its python: the CPU server's environment), h1 serves nothing
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": str(python), "sglang_port": server.port},
                                                      "h1": {"sglang_port": silent}})
    runs = tmp_path / "runs"
    write_e2e_run(runs, "20240101-000000-aaaa", "h0", [e2e_row("no-spec", None), e2e_row("ddtree-b8", live + 0.3)],
                  command="qualify")
    argv = ["status", "-i", str(inventory), "--runs-dir", str(runs), "--min-request-rounds", "20", "--json"]

    code = main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    h0, h1 = doc["hosts"]["h0"]["result"], doc["hosts"]["h1"]["result"]
    assert h0["sglang"] == "0.5.23" and h0["server"] == {"state": "running", "port": server.port}
    assert h0["ddtree"] == {"enabled": True, "budget": BUDGET, "from": "the server"}
    assert h0["live"]["request_rounds"] == requests >= 20
    assert h0["live"]["acceptance_length"] == pytest.approx(live, rel=1e-12)
    assert h0["reference"]["run_id"] == "20240101-000000-aaaa" and h0["reference"]["command"] == "qualify"
    assert (h0["verdict"], h0["note"]) == ("ok", "within 0.5 of qualification run 20240101-000000-aaaa")
    assert (h1["server"]["state"], h1["note"]) == ("not-running", f"no server running on port {silent}")

    # A newer passing sglang-e2e that accepted far more at this budget: the live figure is below it.
    write_e2e_run(runs, "20240102-000000-aaaa", "h0", [e2e_row("ddtree-b8", live + 2.0)])
    code = main([*argv, "-H", "h0"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 5, doc
    assert doc["hosts"]["h0"]["error"] == (
        f"h0: live acceptance {live:.3f} at budget {BUDGET} is below {live + 2.0:.3f} of sglang-e2e run "
        f"20240102-000000-aaaa by more than 0.5")
