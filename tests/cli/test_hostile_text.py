"""Text from hosts and files reaches the operator's terminal inert: control characters shown as
escapes, Rich markup and emoji codes never read; `--json` keeps the exact text."""
from __future__ import annotations

import json
import os
import re
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree_ops.cli.app import main  # noqa: E402
from ddtree_ops.cli.console import inert  # noqa: E402
from ddtree_ops.results import RunStore  # noqa: E402
from ddtree_ops.hostside.protocol import EventKind, encode_event, make_event  # noqa: E402

# clipboard write (OSC 52), screen clear, title change, a bare CR that overdraws the line, a
# one-byte C1 CSI, a bidi override, BEL, and Rich markup and emoji codes
HOSTILE = ("\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x1b]0;pwned\x07\rPASS \x9b31m\u202e[/bold][red]:rocket:"
           "\x1b[32mok\x1b[0m")
# A terminal acts on these; none may reach it from foreign text (Rich's own SGR colour codes aside).
_RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def assert_inert(text: str) -> None:
    assert not _RAW_CONTROL.search(text), repr(_RAW_CONTROL.search(text))
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07" in text and "\\x9b31m" in text and "\\u202e" in text
    assert "[/bold][red]:rocket:" in text  # shown as written, neither markup nor emoji


def test_inert_escapes_every_control_class_and_keeps_printable_text():
    assert inert("caf\u00e9 \u4e2d [b] tab\there\nnext") == "caf\u00e9 \u4e2d [b] tab\there\nnext"
    assert inert("a\nb", one_line=True) == "a\\nb"
    assert inert("\x1b[2J\x07\r\x00\x7f\x85\x9b\u200f\u202e\u2028\ud800") == \
        "\\x1b[2J\\x07\\r\\x00\\x7f\\x85\\x9b\\u200f\\u202e\\u2028\\ud800"


def _hostile_run(root: Path) -> None:
    store = RunStore(root)
    store.create_run("r1", {"hosts": ["h"], "stages": ["golden"]})
    recorder = store.host_recorder("r1", "h", {})
    recorder.feed_line(encode_event(make_event(EventKind.RUN_START, "r1", "h", stages=["golden"])))
    recorder.feed_line(encode_event(make_event(
        EventKind.STAGE_END, "r1", "h", stage="golden", index=0, status="fail", reason=HOSTILE,
        duration_s=1.0, metrics={}, tables={}, traceback=f"Traceback\nValueError: {HOSTILE}", output_tail=None)))
    recorder.feed_line(encode_event(make_event(EventKind.RUN_END, "r1", "h", status="fail")))
    recorder.close()


def test_report_shows_hostile_reasons_and_tracebacks_inert_and_json_exact(tmp_path, capsys, monkeypatch):
    _hostile_run(tmp_path)
    monkeypatch.setenv("FORCE_COLOR", "1")  # colours on: Rich's own codes, none of the host's
    assert main(["report", "r1", "--runs-dir", str(tmp_path)]) == 0
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert_inert(shown)
    assert "FAIL h / golden: \\x1b]52" in shown
    assert main(["report", "r1", "--runs-dir", str(tmp_path), "--json"]) == 0
    [failure] = json.loads(capsys.readouterr().out)["failures"]
    assert failure["reason"] == HOSTILE


def _reference_run(path: Path, method: str) -> Path:
    record = types.SimpleNamespace(
        output_ids=torch.tensor([[1, 2, 3, 4]]), num_input_tokens=2, num_output_tokens=2,
        time_to_first_token=0.0, time_per_output_token=0.01, acceptance_lengths=[2],
        decode_rounds=1, stage_times={}, round_timestamps=[], round_trees=None)
    torch.save({"responses": [{"baseline": record, method: record}], "block_size": 16,
                "args": {"dataset": "gsm8k", "model_name_or_path": "Qwen/Qwen3-4B", "temperature": 0.0}}, path)
    return path


def test_baseline_import_shows_a_hostile_method_name_inert(tmp_path, capsys):
    run = _reference_run(tmp_path / "a.pt", HOSTILE)
    out = tmp_path / "baseline.json"
    assert main(["baseline", "import", str(run), "-o", str(out)]) == 0  # `[/bold]` crashed Rich
    captured = capsys.readouterr()
    assert_inert(captured.err)
    assert HOSTILE in {entry["method"] for entry in json.loads(out.read_text())["entries"]}


def test_a_hosts_error_text_reaches_the_terminal_inert(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(1)
    python = tmp_path / "python"
    hostile = HOSTILE.encode("utf-8")
    (tmp_path / "says").write_bytes(hostile)
    python.write_text(f"#!/bin/sh\ncat '{tmp_path / 'says'}' >&2\nexit 3\n")  # a host answering with escapes
    os.chmod(python, 0o755)
    inventory = fleet.write_inventory(host_overrides={"h0": {"python": str(python)}})
    code = main(["hosts", "check", "-i", str(inventory)])
    captured = capsys.readouterr()
    assert code == 5, captured
    assert_inert(captured.out + captured.err)
