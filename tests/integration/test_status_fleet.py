"""`ddtree-ops status` over the real sshd fleet, the host-side part for real (the agent's
`server-status` in each host's Python, fetching 127.0.0.1:<port>/metrics there): a host with
no server says so, a port answering without /metrics says so, a /metrics that is not the text
format fails its host (exit 5), and `--watch --json` streams one document per poll. (A real
SGLang server behind a host: tests/sglang_server/test_metrics_and_status.py.)"""
from __future__ import annotations

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddtree_ops.cli.app import main
from sshd_fleet import free_port

pytestmark = [pytest.mark.sshd, pytest.mark.slow]


@pytest.fixture
def web(tmp_path):
    """A real HTTP server on 127.0.0.1 serving a folder (its `metrics` file is /metrics)."""
    folder = tmp_path / "site"
    folder.mkdir()
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], folder
    server.shutdown()
    server.server_close()


def status(capsys, inventory, *args: str) -> tuple[int, dict]:
    code = main(["status", "-i", str(inventory), "--runs-dir", str(inventory.parent / "runs"), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_hosts_without_a_metrics_server_say_what_they_have(sshd_fleet, web, capsys):
    port, _ = web
    silent = free_port()
    fleet = sshd_fleet(2)
    inventory = fleet.write_inventory(host_overrides={"h0": {"sglang_port": port}, "h1": {"sglang_port": silent}})
    code, doc = status(capsys, inventory)
    assert code == 0, doc
    h0, h1 = doc["hosts"]["h0"]["result"], doc["hosts"]["h1"]["result"]
    assert h0["server"]["state"] == "no-metrics" and "HTTP 404" in h0["server"]["error"]
    assert h0["note"] == f"the server on port {port} serves no /metrics (start it with --enable-metrics)"
    assert (h1["server"]["state"], h1["note"]) == ("not-running", f"no server running on port {silent}")
    for result in (h0, h1):
        assert result["verdict"] == "not judged" and result["live"] is None
        assert result["deployed"]["record"] is None  # nothing deployed into this Python by these workdirs
        assert result["sglang"] is None  # the test's own Python has no sglang

    # --port overrides every host's sglang_port
    code, doc = status(capsys, inventory, "--port", str(silent))
    assert code == 0 and {h["result"]["server"]["state"] for h in doc["hosts"].values()} == {"not-running"}


def test_a_metrics_text_that_is_not_one_fails_its_host(sshd_fleet, web, capsys):
    port, folder = web
    (folder / "metrics").write_text('ddtree_budget_nodes{model_name="m" 8\n')
    inventory = sshd_fleet(1).write_inventory(host_overrides={"h0": {"sglang_port": port}})
    code, doc = status(capsys, inventory)
    assert code == 5, doc
    assert doc["hosts"]["h0"]["error"].startswith("h0: /metrics: not Prometheus' text format")


def test_watch_streams_one_json_document_per_poll(sshd_fleet, capsys):
    silent = free_port()
    inventory = sshd_fleet(1).write_inventory(host_overrides={"h0": {"sglang_port": silent}})
    code = main(["status", "-i", str(inventory), "--json", "--watch", "--interval", "0.5", "--count", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and len(lines) == 2
    polls = [json.loads(line) for line in lines]
    assert [p["poll"] for p in polls] == [1, 2]
    assert all(p["command"] == "status" and p["hosts"]["h0"]["result"]["server"]["state"] == "not-running"
               for p in polls)
