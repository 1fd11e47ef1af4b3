"""The stage protocol and record format (ddtree_ops/hostside/protocol.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddtree_ops.hostside.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    STAGE_ORDER,
    EventKind,
    SmokeOptions,
    StageResult,
    Status,
    decode_event,
    encode_event,
    jsonable,
    make_event,
    stage_module_name,
)

REPO = Path(__file__).resolve().parents[2]


def test_stage_module_names_and_order():
    assert stage_module_name("tree-bench") == "tree_bench"
    assert stage_module_name("sglang-e2e") == "sglang_e2e"
    assert STAGE_ORDER[:5] == ("env", "import", "golden", "invariants", "tree-bench")
    assert len(set(STAGE_ORDER)) == len(STAGE_ORDER)


@pytest.mark.parametrize("stage", ["env", "import", "golden", "invariants", "tree-bench"])
def test_each_shipped_stage_module_declares_the_protocol(stage):
    import importlib

    module = importlib.import_module(f"ddtree_ops.hostside.stages.{stage_module_name(stage)}")
    assert module.NAME == stage
    assert isinstance(module.DESCRIPTION, str) and module.DESCRIPTION
    assert callable(module.run)


def test_options_round_trip_and_errors_name_the_field():
    opts = SmokeOptions.from_dict({"budgets": [0, 16], "batch_sizes": [1], "seed": 7,
                                   "repeat": 2, "extra": {"vocab": 100}})
    assert SmokeOptions.from_dict(opts.to_dict()) == opts
    assert SmokeOptions.from_dict({}).budgets == [16, 32, 64, 128, 256, 512, 1024]
    with pytest.raises(ValueError, match=r"budgets: expected an integer >= 0, got -3"):
        SmokeOptions.from_dict({"budgets": [16, -3]})
    with pytest.raises(ValueError, match=r"batch_sizes: expected an integer >= 1, got 0"):
        SmokeOptions.from_dict({"batch_sizes": [0]})
    with pytest.raises(ValueError, match=r"unknown keys \['budget'\]"):
        SmokeOptions.from_dict({"budget": [1]})


def test_jsonable_converts_tensors_and_non_finite_floats():
    import torch

    value = {"t": torch.tensor([1, 2]), "s": torch.tensor(1.5), "nan": float("nan"),
             "inf": float("inf"), "status": Status.PASS, "nested": [(1, 2.0)]}
    assert jsonable(value, "m") == {"t": [1, 2], "s": 1.5, "nan": "nan", "inf": "inf",
                                    "status": "pass", "nested": [[1, 2.0]]}
    with pytest.raises(TypeError, match=r"metric x\.y: not JSON-serialisable: object"):
        jsonable({"y": object()}, "metric x")


def test_event_lines_are_strict_json_and_decode_back():
    record = make_event(EventKind.STAGE_END, "run-1", "gpu-a", stage="env", status="pass",
                        metrics={"ratio": float("nan")})
    line = encode_event(record)
    assert "\n" not in line and "NaN" not in line
    decoded = decode_event(line)
    assert decoded["v"] == PROTOCOL_VERSION and decoded["event"] == "stage_end"
    assert decoded["run_id"] == "run-1" and decoded["host"] == "gpu-a"
    assert decoded["metrics"] == {"ratio": "nan"}
    assert isinstance(decoded["time"], float)
    assert decode_event("some stray output") is None
    assert decode_event('{"not": "a record"}') is None
    assert decode_event("{broken") is None


def test_stage_result_constructors():
    assert StageResult.passed("ok").status is Status.PASS
    failed = StageResult.failed("why", metrics={"a": 1})
    assert (failed.status, failed.reason, failed.metrics) == (Status.FAIL, "why", {"a": 1})
    assert StageResult.skipped("no gpu").status is Status.SKIP
    assert json.loads(json.dumps(Status.NOT_RUN.value)) == "not_run"


def test_smoke_package_imports_only_ddtree_stdlib_and_torch():
    import re

    # sglang_ddtree_utils: the seed script's own import line, carried as text by `golden`
    allowed = set(sys.stdlib_module_names) | {"torch", "ddtree", "ddtree_ops", "sglang_ddtree_utils"}
    pattern = re.compile(r"^\s*(?:import|from)\s+([a-zA-Z_]+)", re.M)
    mine = ["__init__.py", "protocol.py", "release_check.py", "runner.py", "safe_write.py", "signals.py", "stage_output.py",
            "stages/__init__.py", "stages/env.py",
            "stages/import.py", "stages/golden.py", "stages/invariants.py",
            "stages/tree_bench.py", "stages/lossless.py", "stages/lossless_full.py",
            "stages/decode_bench.py"]
    for path in (REPO / "ddtree_ops" / "hostside" / name for name in mine):
        imported = set(pattern.findall(path.read_text()))
        assert imported <= allowed, (path, imported - allowed)


@pytest.mark.slow
def test_command_help_imports_no_torch_or_ssh_libraries():
    import subprocess

    code = ("import contextlib, io, sys, json\nfrom ddtree_ops.cli.app import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    for args in (['smoke', '--help'], ['report', '--help'], ['collect', '--help'],"
            " ['bench', '--help']):\n        assert main(args) == 0, args\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & {"torch", "paramiko", "fabric", "matplotlib"}, loaded


@pytest.mark.parametrize("extra, message", [
    ({"vocab": "abc"}, "--set vocab: expected an integer >= 1, got 'abc'"),
    ({"depth": 0}, "--set depth: expected an integer >= 1, got 0"),
    ({"vocab": 5.0}, "--set vocab: expected an integer >= 1, got 5.0"),
    ({"temperature": -0.5}, "--set temperature: expected a number >= 0, got -0.5"),
    ({"strict": "yes"}, "--set strict: expected true or false, got 'yes'"),
    ({"sglang_budgets": [16, 0]}, "--set sglang_budgets: expected a list of integers >= 1, got [16, 0]"),
    ({"sglang_extra_args": "--tp 2"}, "--set sglang_extra_args: expected a list of strings, got '--tp 2'"),
    ({"max_prompts": True}, "--set max_prompts: expected an integer >= 1, got True"),
])
def test_a_bad_knob_is_refused_naming_it(extra, message):
    with pytest.raises(ValueError) as caught:
        SmokeOptions.from_dict({"extra": extra})
    assert str(caught.value) == message


def test_good_knobs_pass():
    extra = {"vocab": 1000, "temperature": 0, "strict": True, "sglang_budgets": [16, 64],
             "sglang_extra_args": ["--tp", "2"]}
    assert SmokeOptions.from_dict({"extra": extra}).extra == extra


def test_an_unknown_knob_is_refused_naming_it_and_the_known_ones():
    from ddtree_ops.hostside.protocol import KNOBS

    with pytest.raises(ValueError) as caught:
        SmokeOptions.from_dict({"extra": {"vocab": 10, "max_new_token": 64}})
    message = str(caught.value)
    assert message.startswith("--set max_new_token: unknown knob (did you mean max_new_tokens?); known knobs: ")
    assert message.split("known knobs: ")[1].split(", ") == sorted(KNOBS)
    with pytest.raises(ValueError, match=r"^--set zzz: unknown knob; known knobs: "):
        SmokeOptions.from_dict({"extra": {"zzz": 1}})


def test_docs_list_every_knob_of_the_table():
    """docs/smoke.md's knob table names exactly the knobs the operator and the runner accept."""
    import re

    from ddtree_ops.hostside.protocol import KNOBS

    text = (REPO / "docs" / "smoke.md").read_text(encoding="utf-8")
    table = text[text.index("| knob | stage | default |"):]
    table = table[:table.index("\n\n")]
    documented = {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert documented == set(KNOBS)
