"""`report --baseline` with a decode baseline: a run holding the rows the real decode-bench
stage produced (tiny target + tiny DFlash drafter, run in-process and recorded the way the
runner records a stage_end), against baselines written by the real `baseline import` code from
torch.save'd files in the reference's layout."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.decode import DecodeConfig, generate_autoregressive, generate_dflash, generate_ddtree  # noqa: E402
from ddtree.dflash_drafter import load_dflash_drafter, load_target  # noqa: E402
from ddtree.lossless import TINY_VOCAB, build_tiny_target, save_tiny_dflash_drafter, tiny_dflash_config  # noqa: E402
from ddtree_ops.report.baselines import import_reference_runs, paper_baseline  # noqa: E402
from ddtree_ops.errors import BaselineFileError, ConfigError  # noqa: E402
from ddtree_ops.report.decode_checks import compare_decode, decode_baseline_overlay  # noqa: E402
from ddtree_ops.report.metric_checks import BaselineKind, load_any_baseline, load_baseline  # noqa: E402
from ddtree_ops.report.model import build_report  # noqa: E402
from ddtree_ops.report.plots import plot_run  # noqa: E402
from ddtree_ops.results import RunStore  # noqa: E402
from ddtree_ops.hostside.protocol import EventKind, SmokeOptions, StageContext, Status, encode_event, jsonable, make_event  # noqa: E402
from ddtree_ops.hostside.stages import decode_bench  # noqa: E402

BUDGETS = [4, 16]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    """The decode-bench stage, run once on tiny models; what it returned and what it decoded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("decode-models")
    build_tiny_target(seed=0, dtype=torch.float32).model.save_pretrained(root / "tiny-target")
    save_tiny_dflash_drafter(root / "tiny-drafter", tiny_dflash_config())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_VOCAB, (6,), generator=generator).tolist() for _ in range(2)]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    models = {"target": str(root / "tiny-target"), "drafter": str(root / "tiny-drafter"), "block_size": 6,
              "prompts": str(root / "prompts.jsonl")}
    ctx = StageContext(stage="decode-bench", device="cpu",
                       options=SmokeOptions(budgets=BUDGETS, extra={"max_new_tokens": NEW_TOKENS}),
                       host={"name": "gpu-a", "models": models}, run_dir=root / "run", release_root=root,
                       expected_release=None, log=lambda message: None, emit_metric=lambda name, value: None)
    result = decode_bench.run(ctx)
    assert result.status is Status.PASS, result.reason
    yield {"result": result, "models": models, "prompts": prompts}
    torch.set_num_threads(before)


def record_run(root: Path, per_host: dict[str, dict]) -> Path:
    """A run store holding, per host, decode-bench's stage_end as the runner writes it."""
    store = RunStore(root)
    store.create_run("r1", {"hosts": list(per_host), "stages": ["decode-bench"]})
    for host, fields in per_host.items():
        recorder = store.host_recorder("r1", host, {})
        recorder.feed_line(encode_event(make_event(EventKind.RUN_START, "r1", host, stages=["decode-bench"])))
        recorder.feed_line(encode_event(make_event(EventKind.STAGE_END, "r1", host, stage="decode-bench", index=0,
                                                   duration_s=1.0, traceback=None, **fields)))
        recorder.feed_line(encode_event(make_event(EventKind.RUN_END, "r1", host, status="pass")))
        recorder.close()
    return root


def stage_fields(result) -> dict:
    return {"status": result.status.value, "reason": result.reason,
            "metrics": jsonable(result.metrics, "metrics"), "tables": jsonable(result.tables, "tables")}


def reference_file(path: Path, responses: list[dict], dataset: str = "prompts", model: str = "local/tiny-target",
                   temperature: float = 0.0) -> Path:
    torch.save({"responses": responses, "block_size": 6, "draft_attn_implementation": "sdpa",
                "target_attn_implementation": "sdpa",
                "args": {"dataset": dataset, "model_name_or_path": model, "temperature": temperature}}, path)
    return path


def offline_responses(bench: dict) -> list[dict]:
    """The same models, prompts and settings decoded here, saved in the reference's layout:
    what an offline reference run of this configuration would hold."""
    target = load_target(bench["models"]["target"], "cpu", torch.float32)
    drafter = load_dflash_drafter(bench["models"]["drafter"], target)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    responses = []
    for ids in bench["prompts"]:
        prompt = torch.tensor([ids])
        methods = {"baseline": generate_autoregressive(target, prompt, config),
                   "dflash": generate_dflash(target, drafter, prompt, config)}
        for budget in BUDGETS:
            methods[f"ddtree_tb{budget}"] = generate_ddtree(target, drafter, prompt, config, budget=budget)
        responses.append({key: result.to_namespace() for key, result in methods.items()})
    return responses


@pytest.fixture(scope="module")
def offline(bench, tmp_path_factory) -> Path:
    """A decode baseline written by the real `baseline import` code from the offline run."""
    folder = tmp_path_factory.mktemp("offline")
    baseline = import_reference_runs([reference_file(folder / "prompts__tiny.pt", offline_responses(bench))])
    path = folder / "offline.json"
    path.write_text(baseline.to_json())
    return path


@pytest.mark.slow
def test_the_stage_rows_match_an_offline_run_of_the_same_configuration(bench, offline, tmp_path):
    report = build_report(RunStore(record_run(tmp_path, {"gpu-a": stage_fields(bench["result"])})).load("r1"))
    kind, baseline = load_any_baseline(offline)
    assert kind is BaselineKind.DECODE
    result = compare_decode(report, baseline, tau_tolerance=1e-9)
    assert result.regressions == [], [c.line() for c in result.regressions]
    metrics = {c.metric for c in result.checks}
    # (no `ddtree_best` cell: an imported run has per-budget cells only; the paper's Table 1 has it)
    assert metrics == {"decode-bench.tau.dflash", "decode-bench.tau.ddtree_tb4", "decode-bench.tau.ddtree_tb16",
                       "decode-bench.identical_to_ar.dflash",
                       "decode-bench.identical_to_ar.ddtree_tb4", "decode-bench.identical_to_ar.ddtree_tb16"}
    assert all(c.host == "gpu-a" for c in result.checks)
    rows = {r["method"]: r for r in result.rows}
    assert rows["ddtree_tb16"]["baseline_cell"] == "prompts · tiny-target · T=0"
    assert rows["ddtree_tb16"]["tau"] == pytest.approx(rows["ddtree_tb16"]["baseline_tau"])


@pytest.mark.slow
def test_a_tau_outside_the_tolerance_is_a_regression_naming_metric_host_expected_measured(bench, tmp_path):
    responses = offline_responses(bench)
    for response in responses:  # the offline run accepted 4 tokens per round at budget 16
        response["ddtree_tb16"].acceptance_lengths = [4] * len(response["ddtree_tb16"].acceptance_lengths)
    baseline = import_reference_runs([reference_file(tmp_path / "better.pt", responses)])
    report = build_report(RunStore(record_run(tmp_path / "runs", {"gpu-a": stage_fields(bench["result"])})).load("r1"))
    measured = next(r["tau"] for r in report.decode if r["method"] == "ddtree_tb16")
    result = compare_decode(report, baseline, tau_tolerance=0.25)
    assert [c.metric for c in result.regressions] == ["decode-bench.tau.ddtree_tb16"]
    assert result.regressions[0].line() == (
        f"decode-bench.tau.ddtree_tb16 on gpu-a: expected 4 ± 0.25, measured {round(measured, 4):g} "
        f"({measured - 4.0:+.3f}, outside tolerance; baseline prompts · tiny-target · T=0)")
    assert result.regressions[0].verdict == "regression"  # below the baseline: a loss
    assert compare_decode(report, baseline, tau_tolerance=4.0).regressions == []


def test_outputs_that_differ_from_ar_at_t0_are_a_regression(bench, offline, tmp_path):
    fields = stage_fields(bench["result"])
    lossy = copy.deepcopy(fields)
    for row in lossy["tables"]["methods"]:
        if row["method"] == "dflash":
            row["identical_to_ar"] = 0.5
    report = build_report(RunStore(record_run(tmp_path, {"gpu-a": fields, "gpu-b": lossy})).load("r1"))
    result = compare_decode(report, load_any_baseline(offline)[1], tau_tolerance=1e-9)
    assert [c.line() for c in result.regressions] == [
        "decode-bench.identical_to_ar.dflash on gpu-b: expected 1, measured 0.5 "
        "(tokens differ from AR at T=0 on 50% of requests)"]


def test_hosts_that_failed_skipped_or_match_no_cell(bench, tmp_path):
    failed = {"status": "fail", "reason": "hosts.gpu-b.models: model path /x: no such folder", "metrics": {},
              "tables": {}}
    skipped = {"status": "skip", "reason": "no models configured for this host", "metrics": {}, "tables": {}}
    report = build_report(RunStore(record_run(tmp_path, {"gpu-a": stage_fields(bench["result"]), "gpu-b": failed,
                                                         "local": skipped})).load("r1"))
    result = compare_decode(report, paper_baseline(), tau_tolerance=0.5)
    lines = [c.line() for c in result.regressions]
    assert lines[0].startswith("decode-bench.tau on gpu-a: expected a baseline cell, measured "
                               "prompts · tiny-target · T=0 (no such cell in the baseline, which has datasets "
                               "aime24, ")
    assert lines[0].endswith("name one with --baseline-dataset / --baseline-model)")
    assert lines[1] == ("decode-bench.methods on gpu-b: expected decode-bench results, measured nothing "
                        "(not measured: decode-bench fail: hosts.gpu-b.models: model path /x: no such folder)")
    assert result.notes == ["local: not compared (decode-bench skip: no models configured for this host)"]
    # Named cells: our prompt set and tiny model stand in for the paper's sweep cell.
    named = compare_decode(report, paper_baseline(), 0.5, dataset="math500", model="Qwen3-8B")
    tau_checks = {c.metric: c for c in named.checks if c.host == "gpu-a" and ".tau." in c.metric}
    # Table 1's DFlash and best-DDTree cells and the sweep's budget 16 (the sweep has no budget 4)
    assert set(tau_checks) == {"decode-bench.tau.dflash", "decode-bench.tau.ddtree_tb16", "decode-bench.tau.ddtree_best"}
    assert tau_checks["decode-bench.tau.dflash"].expected == 7.79 and not tau_checks["decode-bench.tau.dflash"].ok

    nothing = build_report(RunStore(record_run(tmp_path / "other", {"local": skipped})).load("r1"))
    assert [c.line() for c in compare_decode(nothing, paper_baseline()).regressions] == [
        "decode-bench.methods: expected decode-bench results, measured nothing "
        "(no host of run r1 measured decode-bench)"]


@pytest.mark.slow
def test_the_overlay_is_the_baseline_sweep_of_the_named_cell_and_it_plots(bench, tmp_path):
    report = build_report(RunStore(record_run(tmp_path, {"gpu-a": stage_fields(bench["result"])})).load("r1"))
    assert decode_baseline_overlay(report, paper_baseline()) == []  # no cell for "prompts"
    overlay = decode_baseline_overlay(report, paper_baseline(), dataset="math500", model="Qwen3-8B")
    sweep = [p for p in overlay if p["budget"] is not None]
    assert [p["budget"] for p in sweep] == [16, 32, 64, 128, 256, 512, 1024]
    assert sweep[0] == {"budget": 16, "tau": 8.606, "speedup": 6.094, "label": "baseline math500 · Qwen3-8B · T=0 · DDTree"}
    assert [p for p in overlay if p["budget"] is None] == [
        {"budget": None, "method": "dflash", "tau": 7.79, "speedup": 5.56,
         "label": "baseline math500 · Qwen3-8B · T=0 · DFlash"}]
    written = plot_run(report, tmp_path / "plots", decode_baseline=overlay)
    assert [p.name for p in written] == ["decode-vs-budget.png"] and written[0].read_bytes()[:4] == b"\x89PNG"


def test_the_baseline_kind_comes_from_the_content(tmp_path, offline):
    metrics = tmp_path / "expected.json"  # a decode-looking name, metrics content
    metrics.write_text(json.dumps({"metrics": [{"metric": "golden.status", "expected": "pass"}]}))
    assert load_any_baseline(metrics)[0] is BaselineKind.METRICS
    decode = tmp_path / "decode.yaml"  # YAML holding a decode baseline
    decode.write_text(offline.read_text())
    kind, baseline = load_any_baseline(decode)
    assert kind is BaselineKind.DECODE and len(baseline.entries) == 4
    with pytest.raises(ConfigError, match="not a baseline: expected a metrics baseline"):
        load_baseline(decode)


@pytest.mark.parametrize("content, message", [
    ('{"runs": []}', "not a baseline: expected a metrics baseline (a mapping with a `metrics:` list) or a decode "
                     "baseline written by `ddtree-ops baseline import|paper`"),
    ("[1, 2]", "not a baseline: expected a metrics baseline"),
    ('{"format": "ddtree-ops-baseline/0", "entries": []}',
     "not a ddtree-ops baseline (format 'ddtree-ops-baseline/0', expected 'ddtree-ops-baseline/1')"),
    ('{"format": "ddtree-ops-baseline/1", "entries": [{"tau": 1}]}', "entries[0]: "),
    ('{"format": "ddtree-ops-baseline/1", "entries": {}}', "entries: expected a list, got dict"),
])
def test_files_that_are_neither_kind_are_refused_with_one_line(tmp_path, content, message):
    path = tmp_path / "base.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_any_baseline(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_a_reference_run_file_is_refused_with_the_import_hint(tmp_path):
    path = reference_file(tmp_path / "run.pt", [{"baseline": 1}])
    with pytest.raises(ConfigError, match=r"a torch.save file \(a reference run\?\): turn it into a baseline with "
                                          r"`ddtree-ops baseline import run.pt -o baseline.json`"):
        load_any_baseline(path)
    assert issubclass(BaselineFileError, ConfigError)  # decode-format errors exit 3 as well


def test_the_paper_baseline_is_the_shipped_file_and_each_table_loads_its_own_cells():
    shipped = Path(__file__).resolve().parents[2] / "baselines"
    paper = paper_baseline()
    assert json.loads(paper.to_json()) == json.loads((shipped / "ddtree-paper.json").read_text())
    kind, table1 = load_any_baseline(shipped / "ddtree-paper-table1.csv")
    assert kind is BaselineKind.DECODE
    by_key = paper.index()
    assert table1.entries and all(by_key[e.key].tau == e.tau and by_key[e.key].speedup == e.speedup
                                  for e in table1.entries)
    assert {e.method for e in table1.entries} == {"dflash", "ddtree_best"}
    _, sweep = load_any_baseline(shipped / "ddtree-paper-budget-sweep.csv")
    assert [e.budget for e in sweep.entries] == [16, 32, 64, 128, 256, 512, 1024]
    assert all(by_key[e.key].tau == e.tau for e in sweep.entries)


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "a CSV with columns a,b is none of the paper's tables (Table 1: temperature,dataset,model,"
                   "method,speedup,tau; budget sweep: budget,speedup,tau); other baselines are JSON or YAML"),
    ("# note\nbudget,speedup,tau\n16,6.0,x\n", "row 1: tau: expected float, got 'x'"),
    ("budget,speedup,tau\n16,nan,8\n", "row 1: speedup: expected a finite number, got 'nan'"),
    ("temperature,dataset,model,method,speedup,tau\n0,MATH-500,Q,EAGLE,1,2\n",
     "row 1: method: expected one of ['DDTree', 'DFlash'], got 'EAGLE'"),
    ('{"runs": [', "not valid JSON: "),  # a .csv holding JSON is read (and named) as JSON
])
def test_a_csv_that_is_no_paper_table_is_refused_naming_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "table.csv"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_any_baseline(path)
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value)
