"""`--json` means one JSON document on stdout, whatever happened: a failure before any host was
contacted (bad option, bad inventory, unknown run or stage) gets `{"command", "exit_code",
"error"}` from the CLI boundary, with the same reason as the one stderr line. Through the real
CLI (`main([...])`) on the `local` host."""
from __future__ import annotations

import json

import pytest
import yaml

from ddtree_ops.cli.app import json_request, main


@pytest.fixture
def env(tmp_path, monkeypatch):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(
        {"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "wd")}}}))
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(inventory))
    monkeypatch.setenv("DDTREE_OPS_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "bad.yaml").write_text("hosts: [\n")
    return tmp_path


def one_document(out: str) -> dict:
    """stdout is exactly one JSON document (json.loads refuses a second one after the first)."""
    assert out.strip(), "nothing on stdout"
    return json.loads(out)


# Failures the commands raise (DdtreeOpsError): the document's error is the stderr line's reason.
RAISED = [
    (["push", "--json", "-H", "nosuch"], "push", 2),
    (["push", "--json", "-H", ""], "push", 2),
    (["push", "--json", "-i", "/nonexist.yaml"], "push", 3),
    (["push", "--json", "-i", "{tmp}/bad.yaml"], "push", 3),
    (["hosts", "check", "--json", "-i", "{tmp}/bad.yaml"], "hosts check", 3),
    (["report", "--json", "nosuchrun"], "report", 2),
    (["smoke", "--json", "--stages", "nosuchstage"], "smoke", 2),
    (["status", "--json", "-H", "nosuch"], "status", 2),
    (["status", "--json", "--watch", "-i", "{tmp}/bad.yaml"], "status", 3),
]


@pytest.mark.parametrize("args,command,code", RAISED, ids=[" ".join(a[:4]) for a, _, _ in RAISED])
def test_a_raised_error_gets_one_json_document(env, capsys, args, command, code):
    args = [a.replace("{tmp}", str(env)) for a in args]
    assert main(args) == code
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()  # stderr keeps its one line
    assert line.startswith("ddtree-ops: error: ")
    assert one_document(captured.out) == {
        "command": command, "exit_code": code, "error": line[len("ddtree-ops: error: "):]}
    # without --json: the same line, and stdout stays empty
    assert main([a for a in args if a != "--json"]) == code
    assert capsys.readouterr() == ("", captured.err)


# Usage errors that Click raises while parsing: the document carries Click's one-line reason.
PARSED = [
    (["push", "--json", "--parallel", "0"], "push", "--parallel"),
    (["collect", "--json"], "collect", "Missing argument 'RUN_ID'"),
    (["push", "--json", "--bogus"], "push", "No such option: --bogus"),
    (["hosts", "check", "--parallel", "x", "--json"], "hosts check", "--parallel"),
    (["nosuchcommand", "--json"], None, "No such command 'nosuchcommand'"),
    (["status", "--json", "--port", "0"], "status", "--port"),
    (["status", "--watch", "--interval", "0", "--json"], "status", "--interval"),
]


@pytest.mark.parametrize("args,command,reason", PARSED, ids=[" ".join(a[:3]) for a, _, _ in PARSED])
def test_a_usage_error_from_click_gets_one_json_document(env, capsys, args, command, reason):
    assert main(args) == 2
    captured = capsys.readouterr()
    doc = one_document(captured.out)
    assert doc["command"] == command and doc["exit_code"] == 2 and reason in doc["error"]
    assert f"Error: {doc['error']}" in captured.err  # Click's usage text stays on stderr
    assert main([a for a in args if a != "--json"]) == 2
    assert capsys.readouterr().out == ""  # without --json: no document


def test_json_is_read_the_way_click_reads_it():
    # a bad value elsewhere does not hide --json; a --set value spelled --json is no request
    assert json_request(["push", "--parallel", "0", "--json"]) == ("push", True)
    assert json_request(["hosts", "check", "--json"]) == ("hosts check", True)
    assert json_request(["smoke", "--set", "--json"]) == ("smoke", False)
    assert json_request(["push", "--", "--json"]) == ("push", False)
    assert json_request(["push", "--bogus", "--json"]) == ("push", True)  # Click cannot parse
    assert json_request(["hosts", "list"]) == ("hosts list", False)
    assert json_request(["baseline", "paper"]) == ("baseline paper", False)  # no --json there


def documented_keys(doc: str, opening: str) -> list[str]:
    """The keys of the `{"command", ...}` list a doc promises, from the first one that starts
    with `opening` (whitespace and line breaks between the keys ignored)."""
    import re
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / doc).read_text().split())
    start = text.index("`{" + opening)
    return re.findall(r'"([a-z_]+)"', text[start:text.index("`", start + 1)])


def test_the_json_keys_the_docs_promise_are_there(env, capsys):
    run_keys = documented_keys("docs/smoke.md", '"command", "exit_code", "run_id"')
    assert {"command", "duration_s", "run_command", "original_exit_code"} <= set(run_keys)
    assert main(["smoke", "--stages", "env", "--json"]) == 0
    smoke = one_document(capsys.readouterr().out)
    assert main(["report", "--json"]) == 0
    report = one_document(capsys.readouterr().out)
    for document, command in ((smoke, "smoke"), (report, "report")):
        assert [key for key in run_keys if key not in document] == []
        assert document["command"] == command and document["run_command"] == "smoke"
    assert smoke["duration_s"] > 0 and report["duration_s"] == smoke["duration_s"]
    fanout_keys = documented_keys("docs/operator-guide.md", '"command", "exit_code", "duration_s"')
    assert fanout_keys[:3] == ["command", "exit_code", "duration_s"] and "hosts" in fanout_keys
    assert main(["push", "--json"]) == 0
    push = one_document(capsys.readouterr().out)
    top, per_host = fanout_keys[:fanout_keys.index("hosts") + 1], fanout_keys[fanout_keys.index("hosts") + 1:]
    assert [key for key in top if key not in push] == []
    assert per_host == ["state", "ok", "duration_s", "result", "error"]
    assert set(per_host) - {"error"} <= set(push["hosts"]["local"])  # `result` when ok, else `error`
