"""`ddtree-ops status` on the operator side: a server's /metrics text (as prometheus_client
writes the plugin's series) read as live figures, the host's reference found in the run store,
and the verdict. (Against a real server over SSH: tests/sglang_server/test_metrics_and_status.py;
the fleet without servers: tests/integration/test_status_fleet.py.)"""
from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from ddtree.sglang.prometheus_export import PrometheusExport
from ddtree.sglang.round_metrics import RoundMetrics
from ddtree_ops.errors import ExitCode, RemoteStepError
from ddtree_ops.live_metrics import parse_metrics
from ddtree_ops.inventory import load_inventory
from ddtree_ops.server_status import AcceptanceDropped, HostStatus, Verdict, find_reference, host_status, judge
from fixtures.e2e_runs import e2e_row, write_e2e_run


def exposition(accept_lens: list[list[int]], budget: int = 8) -> str:
    """The text SGLang's /metrics serves for the plugin's series after these rounds."""
    registry = CollectorRegistry()
    export = PrometheusExport("m", budget, max_acceptance=6, registry=registry)
    metrics = RoundMetrics(1, "cpu", export.export, max_acceptance=6)
    for lens in accept_lens:
        metrics.record(torch.tensor(lens), torch.full((len(lens),), budget + 1), lambda: 1.5,
                       branching=torch.tensor(lens) > 2)
    return generate_latest(registry).decode()


def test_the_live_figures_are_the_plugins_sums():
    live = parse_metrics("h0", exposition([[1, 3], [4], [2, 2, 2]]))
    assert (live.ddtree, live.budget, live.request_rounds, live.rounds) == (True, 8, 6, 3)
    assert live.acceptance_length == pytest.approx(14 / 6)
    assert (live.mean_tree_size, live.branching_trees, live.mean_build_ms) == (9.0, 2, pytest.approx(1.5))
    assert live.gen_throughput is None  # SGLang's own series were not in this text
    off = parse_metrics("h0", "# TYPE sglang:gen_throughput gauge\nsglang:gen_throughput{model_name=\"m\"} 12.5\n"
                              "# TYPE sglang:fwd_occupancy gauge\nsglang:fwd_occupancy NaN\n")  # SGLang serves NaN there
    assert (off.ddtree, off.budget, off.acceptance_length, off.gen_throughput) == (False, None, None, 12.5)


@pytest.mark.parametrize("text, why", [
    ("ddtree_budget_nodes{model_name=\"m\" 8\n", "not Prometheus' text format"),
    ("ddtree_rounds_total NaN\n", "not a count"),
    ("ddtree_rounds_total -4\n", "not a count"),
])
def test_a_metrics_text_that_is_not_one_fails_the_host(text, why):
    with pytest.raises(RemoteStepError, match=f"^h0: /metrics: .*{why}") as caught:
        parse_metrics("h0", text)
    assert caught.value.exit_code == ExitCode.REMOTE


def test_the_reference_is_the_newest_passing_sglang_e2e_at_that_budget(tmp_path):
    rows = lambda b8, b16: [e2e_row("no-spec", None), e2e_row("ddtree-b8", b8), e2e_row("ddtree-b16", b16)]  # noqa: E731
    write_e2e_run(tmp_path, "20240101-000000-aaaa", "h0", rows(2.5, 3.0), command="qualify")
    write_e2e_run(tmp_path, "20240102-000000-aaaa", "h0", rows(1.9, 2.9))
    write_e2e_run(tmp_path, "20240103-000000-aaaa", "h0", rows(1.0, 1.0), status="fail")  # never a reference
    write_e2e_run(tmp_path, "20240104-000000-aaaa", "h1", rows(9.0, 9.0))  # another host's
    newest = find_reference(tmp_path, "h0", 8)
    assert (newest.run_id, newest.acceptance_length, newest.described) == \
        ("20240102-000000-aaaa", 1.9, "sglang-e2e run 20240102-000000-aaaa")
    write_e2e_run(tmp_path, "20240105-000000-aaaa", "h0", [e2e_row("ddtree-b16", 3.1)], command="qualify")
    assert find_reference(tmp_path, "h0", 16).described == "qualification run 20240105-000000-aaaa"
    assert find_reference(tmp_path, "h0", 8).run_id == "20240102-000000-aaaa"  # the newest has no budget 8
    assert find_reference(tmp_path, "h0", 32) is None and find_reference(tmp_path / "none", "h0", 8) is None


def running(text: str) -> HostStatus:
    """What a host's reply with a running server whose /metrics is `text` reads as."""
    return host_status(load_inventory(None).hosts["local"], 30000, {
        "sglang": {"installed": True, "version": "0.5.23"}, "deployed": {"record": None},
        "server": {"state": "running", "port": 30000, "metrics": text}})


def test_a_live_acceptance_below_the_reference_fails_naming_host_budget_and_both_numbers(tmp_path):
    write_e2e_run(tmp_path, "20240101-000000-aaaa", "h0", [e2e_row("ddtree-b8", 3.4)])
    reference = find_reference(tmp_path, "h0", 8)
    text = exposition([[2, 3]] * 60)  # 120 request-rounds at 2.5
    with pytest.raises(AcceptanceDropped) as caught:
        judge(running(text), "h0", reference, tolerance=0.5, min_request_rounds=100)
    assert str(caught.value) == ("h0: live acceptance 2.500 at budget 8 is below 3.400 of sglang-e2e run "
                                 "20240101-000000-aaaa by more than 0.5")
    assert caught.value.exit_code == ExitCode.REMOTE and caught.value.details["verdict"] == Verdict.BELOW
    assert judge(running(text), "h0", reference, tolerance=1.0, min_request_rounds=100).verdict == Verdict.OK


def test_what_cannot_be_judged_says_why(tmp_path):
    none = judge(running(exposition([[2, 3]] * 60)), "h0", None, 0.5, 100)
    assert (none.verdict, none.note) == (Verdict.NOT_JUDGED, "no passing sglang-e2e at budget 8 for this host in the "
                                         "run store (ddtree-ops smoke -H h0 --stages sglang-e2e --budgets 8)")
    write_e2e_run(tmp_path, "20240101-000000-aaaa", "h0", [e2e_row("ddtree-b8", 3.4)])
    few = judge(running(exposition([[1, 1]] * 10)), "h0", find_reference(tmp_path, "h0", 8), 0.5, 100)
    assert (few.verdict, few.note) == (Verdict.NOT_JUDGED, "20 request-rounds so far; judged from 100")
    down = HostStatus(sglang=None, deployed={"record": None}, server={"state": "not-running", "port": 31234})
    assert judge(down, "h0", None, 0.5, 100).note == "no server running on port 31234"
    plain = running("# TYPE sglang:gen_throughput gauge\nsglang:gen_throughput 3.0\n")
    assert judge(plain, "h0", None, 0.5, 100).note.startswith("DDTree is off in the server on port 30000")


def test_a_reply_of_the_wrong_shape_reads_as_nothing_known():
    host = load_inventory(None).hosts["local"]
    odd = host_status(host, 30000, {"sglang": ["0.5.23"], "deployed": {"record": "/r.json", "server_defaults": {
        "DDTREE_ENABLE": 1}}, "server": {"state": "not-running", "port": 1}})
    assert odd.sglang is None and odd.server == {"state": "not-running", "port": 30000}  # the port asked for, not the host's
    assert odd.ddtree == {"enabled": False, "budget": 32, "from": "deploy --budget"}
    bare = host_status(host, 30000, {})
    assert bare.server["state"] == "error" and judge(bare, "local", None, 0.5, 100).note.startswith("port 30000: ")


def test_the_table_row_says_what_the_json_says(tmp_path):
    from ddtree_ops.cli.status import COLUMNS, row

    write_e2e_run(tmp_path, "20240101-000000-aaaa", "h0", [e2e_row("ddtree-b8", 2.6)], command="qualify")
    judged = judge(running(exposition([[2, 3]] * 60)), "h0", find_reference(tmp_path, "h0", 8), 0.5, 100)
    cells = dict(zip(COLUMNS, row(judged.to_dict())))
    assert cells == {"sglang": "0.5.23", "plugin": "none", "ddtree": "on, budget 8", "server": ":30000 running",
                     "live acceptance": "2.500 over 120 request-rounds",
                     "reference": "2.600 (qualification run 20240101-000000-aaaa)",
                     "verdict": "ok: within 0.5 of qualification run 20240101-000000-aaaa"}
    deployed = HostStatus(sglang=None, deployed={"record": "/wd/deployments/x/record.json", "release": "0da44e92",
                                                 "deployed_at": "2026-12-01T10:00:00Z"},
                          server={"state": "not-running", "port": 30000},
                          ddtree={"enabled": True, "budget": 64, "from": "deploy --budget"})
    cells = dict(zip(COLUMNS, row(judge(deployed, "h0", None, 0.5, 100).to_dict())))
    assert (cells["plugin"], cells["ddtree"], cells["server"]) == \
        ("0da44e92 (2026-12-01T10:00:00Z)", "on, budget 64 (as deployed: deploy --budget)", ":30000 not running")
