"""`deploy --budget auto --for-concurrency N` takes DDTree's server defaults from the host's latest
recommendation in the local run store, and refuses before touching any host when there is none.
The run records are written through RunStore as the host runner writes them."""
from __future__ import annotations

import json

import pytest
import yaml
from test_report_recommend_cli import BUSY, QUIET, load_rows, lossless_rows, write_run

from ddtree_ops.cli.app import main
from ddtree_ops.deploy_budget import auto_defaults, explicit_defaults
from ddtree_ops.errors import ConfigError


def test_auto_takes_the_newest_run_measured_at_that_level(tmp_path):
    write_run(tmp_path, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0) + load_rows(8, 400.0, 600.0, 380.0), QUIET)},
              run_id="20261201-100000-aaaa")
    # A newer run that measured only one concurrent request: it decides level 1, not level 8.
    write_run(tmp_path, {"gpu-a": (load_rows(1, 100.0, 300.0, 200.0), QUIET)}, run_id="20261201-110000-bbbb")

    at_8 = auto_defaults(tmp_path, "gpu-a", 8)
    assert at_8.variables == {"DDTREE_ENABLE": "0"}
    assert at_8.provenance == {"source": "--budget auto", "run": "20261201-100000-aaaa", "concurrency": 8,
                               "choice": "dflash"}
    assert at_8.note.startswith("DDTree does not pay at 8 concurrent on gpu-a: deployed disabled")
    assert auto_defaults(tmp_path, "gpu-a", 1).provenance["run"] == "20261201-110000-bbbb"
    assert auto_defaults(tmp_path, "gpu-a", 1).variables == {"DDTREE_ENABLE": "0"}

    write_run(tmp_path, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-120000-cccc")
    at_1 = auto_defaults(tmp_path, "gpu-a", 1)
    assert at_1.variables == {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "64"}
    assert at_1.to_payload()["provenance"]["run"] == "20261201-120000-cccc"
    assert explicit_defaults(16).variables == {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "16"}


def test_auto_refuses_naming_host_level_and_the_run_that_would_decide(tmp_path):
    write_run(tmp_path, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET),
                         "gpu-b": (load_rows(1, 100.0, 200.0, 300.0), BUSY)})
    with pytest.raises(ConfigError) as err:
        auto_defaults(tmp_path, "gpu-a", 8)
    assert str(err.value) == (f"gpu-a: --budget auto: no sglang-e2e measurement at 8 concurrent under {tmp_path}; "
                              "run `ddtree-ops smoke -H gpu-a --stages sglang-e2e --set sglang_concurrency=8` first")
    with pytest.raises(ConfigError, match=r"^gpu-b: --budget auto: run r1 cannot decide at 1 concurrent \(too noisy"
                                          r".*sglang_concurrency=1` again, or pass --budget N$"):
        auto_defaults(tmp_path, "gpu-b", 1)


@pytest.mark.parametrize("args, code, message", [
    (["--budget", "auto"], 2, "--budget auto: needs --for-concurrency N"),
    (["--budget", "64", "--for-concurrency", "8"], 2, "--for-concurrency: only with --budget auto"),
    (["--budget", "many"], 2, "--budget: expected auto or an integer, got 'many'"),
    (["--budget", "0"], 2, "--budget: must be an integer between 1 and 1024, got 0"),
    (["--budget", "5000"], 2, "--budget: must be an integer between 1 and 1024, got 5000"),
    (["--budget", "-3"], 2, "--budget: must be an integer between 1 and 1024, got -3"),
    (["--budget", "auto", "--for-concurrency", "8"], 3, "gpu-a: --budget auto: no sglang-e2e measurement at 8"),
])
def test_deploy_refuses_before_connecting(tmp_path, capsys, args, code, message):
    """The host's name does not resolve: reaching for it would end in exit 4, not these."""
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)})
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu-a": {"hostname": "gpu-a.invalid"}}}))
    assert main(["deploy", "-i", str(inventory), "-H", "gpu-a", "--runs-dir", str(tmp_path / "runs"), *args]) == code
    assert message in capsys.readouterr().err


def deploy_auto(tmp_path, capsys, *extra):
    """deploy --budget auto --dry-run against a host whose name does not resolve: a refusal
    must come before any attempt to reach it (that would be exit 4)."""
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu-a": {"hostname": "gpu-a.invalid"}}}))
    code = main(["deploy", "-i", str(inventory), "-H", "gpu-a", "--runs-dir", str(tmp_path / "runs"),
                 "--budget", "auto", "--for-concurrency", "1", "--dry-run", *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("write, why", [
    (dict(status="fail", reason="ddtree-b64: prompt 0 differs at token 3"),
     "not lossless: the sglang-e2e stage did not pass (fail: ddtree-b64: prompt 0 differs at token 3)"),
    (dict(lossless=lambda load: None), "not lossless: no lossless check (sglang_e2e row) for variant 'dflash'"),
    (dict(lossless=lambda load: lossless_rows(load)[:2]),
     "not lossless: no lossless check (sglang_e2e row) for variant 'ddtree-b64'"),
])
def test_auto_refuses_a_run_whose_lossless_check_failed_or_is_missing(tmp_path, capsys, write, why):
    # an older run passed and would say DDTree: the newest run, lossy, is what the host runs now
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-100000-aaaa")
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-110000-bbbb",
              **write)
    code, err = deploy_auto(tmp_path, capsys)
    assert code == 3, err
    assert f"gpu-a: --budget auto: run 20261201-110000-bbbb cannot decide at 1 concurrent ({why}" in err
    assert "DDTREE_BUDGET" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", [5000, True, -3, "64", None])
def test_auto_refuses_a_budget_the_plugin_would_refuse_naming_it(tmp_path, capsys, bad):
    rows = [dict(row, budget=bad) if row["mode"] == "ddtree" else row for row in load_rows(1, 100.0, 200.0, 300.0)]
    write_run(tmp_path / "runs", {"gpu-a": (rows, QUIET)})
    code, err = deploy_auto(tmp_path, capsys)
    assert code == 3, err
    assert f"has a budget that must be an integer between 1 and 1024, got {bad!r}" in err


LOSSY = dict(status="fail", reason="ddtree-b64: prompt 0 differs at token 3")


def test_a_run_named_under_a_fast_clock_is_not_the_newest(tmp_path, capsys):
    """#49 item 8: a run made while the clock was set ahead is named 20990101-...; a run made
    after it (the clock put right) failed its lossless check. "Newest" is the order the run
    store created them in, so --budget auto refuses on the truly newer run; by name, the 2099
    run decided forever."""
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20990101-000000-aaaa")
    write_run(tmp_path / "runs", {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261207-100000-bbbb",
              **LOSSY)
    code, err = deploy_auto(tmp_path, capsys)
    assert code == 3, err
    assert "gpu-a: --budget auto: run 20261207-100000-bbbb cannot decide at 1 concurrent (not lossless" in err
    assert main(["report", "--runs-dir", str(tmp_path / "runs"), "--json"]) in (0, 5)
    assert '"run_id": "20261207-100000-bbbb"' in capsys.readouterr().out


def test_a_hand_named_copy_of_an_old_run_is_not_the_newest(tmp_path, capsys):
    """A copy of an older, passing run under a name dated in the future, its run id rewritten
    in every file (so its records are consistent), is not the newest: the store made it first.
    A run this store did not create and whose name is dated in the future is left out, named."""
    import shutil

    runs = tmp_path / "runs"
    write_run(runs, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-100000-aaaa")
    write_run(runs, {"gpu-a": (load_rows(1, 100.0, 200.0, 300.0), QUIET)}, run_id="20261201-110000-bbbb", **LOSSY)
    shutil.copytree(runs / "20261201-100000-aaaa", runs / "20991231-235959-ffff")
    for path in (runs / "20991231-235959-ffff").rglob("*"):
        if path.is_file():
            path.write_text(path.read_text().replace("20261201-100000-aaaa", "20991231-235959-ffff"))
    code, err = deploy_auto(tmp_path, capsys)
    assert code == 3 and "run 20261201-110000-bbbb cannot decide" in err, err

    shutil.rmtree(runs / "20261201-100000-aaaa")
    shutil.rmtree(runs / "20261201-110000-bbbb")
    meta = runs / "20991231-235959-ffff" / "run.json"  # now as if made elsewhere, or by an older ddtree-ops
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "created"}))
    code, err = deploy_auto(tmp_path, capsys)
    assert code == 3, err
    assert ("gpu-a: --budget auto: no sglang-e2e measurement at 1 concurrent under "
            f"{runs} (left out: 20991231-235959-ffff: dated 2099-12-31, in the future (a clock set ahead, or a folder "
            "named by hand), and not created by this run store)") in err
