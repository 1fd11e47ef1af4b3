"""Reference run files read by the restricted loader, the paper's numbers, and the comparison."""
from __future__ import annotations

import json
import os
import pickle
import types
from pathlib import Path

import pytest
import torch

from ddtree.runsummary import MethodSummary, summarize_methods
from ddtree_ops.report.baselines import (
    PAPER_DIR,
    Baseline,
    compare_summaries,
    import_reference_runs,
    load_reference_run,
    paper_baseline,
    read_baseline,
)
from ddtree_ops.errors import BaselineFileError, ExitCode


def record(new_tokens, lengths, tpot, prompt=(1, 2, 3)):
    """One method's record exactly as the reference's benchmark.py stores it."""
    ids = torch.tensor([list(prompt) + list(new_tokens)], dtype=torch.long)
    return types.SimpleNamespace(
        output_ids=ids, num_input_tokens=len(prompt), num_output_tokens=len(new_tokens),
        time_to_first_token=0.01, time_per_output_token=tpot, acceptance_lengths=list(lengths),
        decode_rounds=len(lengths), stage_times={"draft": 0.1, "verify": 0.3, "commit": 0.1},
        round_timestamps=[0.1 * i for i in range(len(lengths))], round_trees=None,
    )


def reference_run(temperature=0.0, dataset="math500", model="Qwen/Qwen3-8B", dflash_tokens=(5, 6, 7, 8)):
    responses = [
        {"baseline": record((5, 6, 7, 8), [1, 1, 1, 1], 0.020),
         "dflash": record(dflash_tokens, [3, 1], 0.010),
         "ddtree_tb16": record((5, 6, 7, 8), [4], 0.005)},
        {"baseline": record((9, 9), [1, 1], 0.030),
         "dflash": record((9, 9), [2], 0.015),
         "ddtree_tb16": record((9, 9), [2], 0.010)},
    ]
    return {
        "responses": responses, "block_size": 16, "draft_attn_implementation": "flash_attention_2",
        "target_attn_implementation": "sdpa",
        "args": {"dataset": dataset, "model_name_or_path": model, "draft_name_or_path": "z-lab/Qwen3-8B-DFlash-b16",
                 "temperature": temperature, "tree_budget": "16", "max_new_tokens": 2048, "flash_attn": False},
    }


def save(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    torch.save(data, path)
    return path


class RunsCode:
    """A pickled object whose unpickling would run a shell command."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_reference_run_loads_and_summarises(tmp_path):
    path = save(tmp_path, "math500__Qwen3-8B__t0__sdpa.pt", reference_run())
    data = load_reference_run(path)
    assert isinstance(data["responses"][0]["dflash"], types.SimpleNamespace)
    baseline = import_reference_runs([path])
    cells = {e.method: e for e in baseline.entries}
    assert set(cells) == {"baseline", "dflash", "ddtree_tb16"}
    ar, dflash, tree = cells["baseline"], cells["dflash"], cells["ddtree_tb16"]
    assert (ar.dataset, ar.model, ar.temperature) == ("math500", "Qwen3-8B", 0.0)
    assert ar.tau == 1.0 and ar.speedup == pytest.approx(1.0)
    assert dflash.tau == pytest.approx((2.0 + 2.0) / 2)  # mean over requests of per-request means
    assert tree.tau == pytest.approx(3.0) and tree.budget == 16
    assert tree.speedup == pytest.approx(0.025 / 0.0075)  # mean AR tpot / mean method tpot
    assert tree.histogram == {1: 0.0, 2: 0.5, 3: 0.0, 4: 0.5}
    assert dflash.histogram == {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}
    assert tree.identical_to_ar == 1.0 and tree.time_per_output_token == pytest.approx(0.0075)
    assert tree.stage_split == pytest.approx({"draft": 0.2, "verify": 0.6, "commit": 0.2})
    assert baseline.sources[0]["file"] == path.name and len(baseline.sources[0]["sha256"]) == 64


def test_token_identity_is_reported_per_method_at_temperature_zero(tmp_path):
    path = save(tmp_path, "run.pt", reference_run(dflash_tokens=(5, 6, 7, 1)))
    cells = {e.method: e for e in import_reference_runs([path]).entries}
    assert cells["dflash"].identical_to_ar == 0.5 and cells["ddtree_tb16"].identical_to_ar == 1.0
    hot = {e.method: e for e in import_reference_runs([save(tmp_path, "hot.pt", reference_run(1.0))]).entries}
    assert hot["dflash"].identical_to_ar is None  # sampling: outputs differ by design


def test_a_file_whose_global_would_run_code_is_refused_and_nothing_runs(tmp_path):
    sentinel = tmp_path / "code-ran"
    data = reference_run()
    data["responses"][0]["baseline"] = RunsCode(sentinel)
    path = save(tmp_path, "evil.pt", data)
    with pytest.raises(BaselineFileError, match=r"evil.pt: refused: the file names the global '(posix|os)\.system'") as err:
        load_reference_run(path)
    assert err.value.exit_code == ExitCode.CONFIG
    assert not sentinel.exists()


class Custom:
    pass


def test_any_other_class_is_refused_by_name(tmp_path):
    data = reference_run()
    data["responses"][0]["baseline"] = Custom()
    path = save(tmp_path, "custom.pt", data)
    with pytest.raises(BaselineFileError, match=r"names the global '.*test_baselines\.Custom'"):
        load_reference_run(path)


@pytest.mark.parametrize(
    "payload, message",
    [
        ([1, 2, 3], "not a reference run: expected a dict, got list"),
        ({"args": {}}, "not a reference run: missing key 'responses'"),
        ({"responses": [], "args": {"dataset": "d", "model_name_or_path": "m", "temperature": 0}},
         "'responses' must be a non-empty list"),
        ({"responses": [{"x": 1}], "args": {"dataset": "d", "temperature": 0}}, "args has no 'model_name_or_path'"),
        ({"responses": [{"dflash": types.SimpleNamespace(acceptance_lengths=[1])}],
          "args": {"dataset": "d", "model_name_or_path": "m", "temperature": 0}},
         r"responses\[0\]\['dflash'\]: missing time_per_output_token, output_ids"),
    ],
)
def test_files_that_are_not_reference_runs_are_named(tmp_path, payload, message):
    path = save(tmp_path, "odd.pt", payload)
    with pytest.raises(BaselineFileError, match=message):
        load_reference_run(path)


def test_non_torch_files_and_missing_files(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a zip archive")
    with pytest.raises(BaselineFileError, match="junk.pt: (not a torch.save file|not a reference run)"):
        load_reference_run(junk)
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps({"responses": []}))
    with pytest.raises(BaselineFileError, match="legacy.pt"):
        load_reference_run(legacy)
    with pytest.raises(BaselineFileError, match="gone.pt: no such file"):
        load_reference_run(tmp_path / "gone.pt")


def test_import_is_all_or_nothing_and_refuses_duplicate_cells(tmp_path):
    good = save(tmp_path, "good.pt", reference_run())
    with pytest.raises(BaselineFileError, match="bad.pt"):
        import_reference_runs([good, save(tmp_path, "bad.pt", {"nope": 1})])
    with pytest.raises(BaselineFileError, match=r"again.pt: \('math500', 'Qwen3-8B', 0.0, 'baseline'\) already comes from good.pt"):
        import_reference_runs([good, save(tmp_path, "again.pt", reference_run())])


def test_baseline_json_round_trip(tmp_path):
    baseline = import_reference_runs([save(tmp_path, "run.pt", reference_run())])
    path = tmp_path / "b.json"
    path.write_text(baseline.to_json())
    again = read_baseline(path)
    assert [e.to_dict() for e in again.entries] == [e.to_dict() for e in baseline.entries]
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(BaselineFileError, match="not a ddtree-ops baseline"):
        read_baseline(path)


def test_paper_numbers_ship_with_their_source():
    baseline = paper_baseline()
    index = baseline.index()
    assert index[("humaneval", "Qwen3-Coder-30B-A3B-Instruct", 0.0, "ddtree_best")].speedup == 8.22
    assert index[("humaneval", "Qwen3-Coder-30B-A3B-Instruct", 0.0, "dflash")].speedup == 6.09
    assert index[("math500", "Qwen3-8B", 0.0, "ddtree_tb64")].tau == 9.748
    hist = index[("math500", "Qwen3-8B", 0.0, "ddtree_tb512")].histogram
    assert len(hist) == 16 and sum(hist.values()) == pytest.approx(1.0, abs=0.01)
    assert sum(index[("math500", "Qwen3-8B", 0.0, "dflash")].histogram.values()) == pytest.approx(1.0, abs=0.01)
    table1 = [e for e in baseline.entries if e.source.endswith("Table 1")]
    assert len(table1) == 120 and {e.temperature for e in table1} == {0.0, 1.0}
    assert all("arXiv 2604.12989" in s["source"] or "DDTree paper" in s["source"] for s in baseline.sources)
    for name in ("ddtree-paper-table1.csv", "ddtree-paper-budget-sweep.csv", "ddtree-paper-acceptance-histogram.csv"):
        assert (PAPER_DIR / name).read_text().startswith("# DDTree paper")


def test_shipped_paper_baseline_file_matches_the_csvs():
    assert (PAPER_DIR / "ddtree-paper.json").read_text() == paper_baseline().to_json()


def summary(method, tau, speedup=None, identical=None, temperature=0.0, dataset="math500"):
    budget = int(method.removeprefix("ddtree_tb")) if method.startswith("ddtree_tb") else None
    return MethodSummary(dataset=dataset, model="Qwen3-8B", temperature=temperature, method=method, budget=budget,
                         tau=tau, speedup=speedup, time_per_output_token=None, histogram={}, requests=1,
                         identical_to_ar=identical)


def test_comparison_checks_tau_tolerance_and_token_identity():
    baseline = paper_baseline()
    run = [summary("ddtree_tb64", 9.6, 6.5, 1.0), summary("ddtree_tb128", 10.2, 6.9, 1.0), summary("dflash", 7.0, 5.0, 1.0)]
    result = compare_summaries(run, baseline, tau_tolerance=0.5)
    rows = {row.key[3]: row for row in result.rows}
    assert rows["ddtree_tb64"].tau_ok and rows["ddtree_tb64"].baseline_tau == 9.748
    assert rows["dflash"].tau_ok is False  # 7.0 vs the paper's 7.79
    assert rows["ddtree_best"].baseline_tau == 10.73 and rows["ddtree_best"].speedup == 6.9  # fastest budget
    assert not result.ok and [r.key[3] for r in result.failures] == ["dflash", "ddtree_best"]  # 10.2 vs 10.73
    assert compare_summaries(run, baseline, tau_tolerance=0.8).ok

    lossy = [summary("ddtree_tb64", 9.7, 6.5, identical=0.5)]
    row = compare_summaries(lossy, baseline, tau_tolerance=1.0).rows[0]
    assert row.tau_ok and row.lossless_ok is False and not row.ok

    unknown = [summary("ddtree_tb64", 3.0, 2.0, 1.0, dataset="ddtree-ops-mini")]
    row = compare_summaries(unknown, baseline, tau_tolerance=0.1).rows[0]
    assert row.tau_ok is None and row.baseline_tau is None and row.ok
    aliased = compare_summaries(unknown, baseline, 0.1, dataset_alias={"ddtree-ops-mini": "math500"}).rows[0]
    assert aliased.baseline_tau == 9.748 and aliased.tau_ok is False
    with pytest.raises(ValueError, match="tau tolerance must be >= 0, got -1"):
        compare_summaries(run, baseline, tau_tolerance=-1)


def test_our_records_summarise_like_the_reference_ones():
    ours = summarize_methods({"baseline": [record((4, 5), [1, 1], 0.02)], "ddtree_tb8": [record((4, 5), [2], 0.01)]},
                             dataset="mini", model="tiny", temperature=0.0)
    assert [(s.method, s.tau, s.speedup, s.identical_to_ar) for s in ours] == [
        ("baseline", 1.0, 1.0, 1.0), ("ddtree_tb8", 2.0, 2.0, 1.0)]
    assert Baseline(entries=ours).index()[("mini", "tiny", 0.0, "ddtree_tb8")].budget == 8


def test_budget_series_for_plots():
    from ddtree_ops.report.baselines import budget_series

    series = budget_series(paper_baseline().entries)
    sweep = series[("math500", "Qwen3-8B", 0.0)]
    assert [b for b, _, _ in sweep] == [16, 32, 64, 128, 256, 512, 1024]
    assert sweep[0] == (16, 8.606, 6.094)
    assert len(series) == 1  # Table 1 cells carry no budget


@pytest.mark.slow
def test_our_decode_records_saved_like_the_reference_import_back(tmp_path):
    """One metrics path for both: our DecodeResults, saved in the reference's layout, load with
    the restricted loader and summarise to the same tau as computed from the results."""
    pytest.importorskip("transformers")
    from ddtree.decode import DecodeConfig, generate_autoregressive, generate_ddtree
    from ddtree.drafters import NoisyTargetDrafter
    from ddtree.lossless import TINY_VOCAB, build_tiny_target, prompt_set
    from ddtree.runsummary import tau

    target = build_tiny_target(seed=0)
    drafter = NoisyTargetDrafter(target, block_size=6, noise=0.3)
    config = DecodeConfig(max_new_tokens=12, save_round_trees=True)
    results = [{"baseline": generate_autoregressive(target, p, config),
                "ddtree_tb8": generate_ddtree(target, drafter, p, config, budget=8)}
               for p in prompt_set(2, 5, TINY_VOCAB, seed=3)]
    run = {"responses": [{k: r.to_namespace() for k, r in item.items()} for item in results],
           "block_size": 6, "draft_attn_implementation": "none", "target_attn_implementation": "sdpa",
           "args": {"dataset": "mini", "model_name_or_path": "local/tiny", "temperature": 0.0}}
    cells = import_reference_runs([save(tmp_path, "ours.pt", run)]).index()
    tree = cells[("mini", "tiny", 0.0, "ddtree_tb8")]
    assert tree.tau == pytest.approx(tau([item["ddtree_tb8"] for item in results]))
    assert tree.identical_to_ar == 1.0 and tree.budget == 8


def test_comparison_rows_name_the_cell_looked_up_and_the_best_budget():
    run = [summary("ddtree_tb64", 9.6, 6.5, 1.0, dataset="mini"), summary("ddtree_tb128", 10.2, 6.9, 0.5, dataset="mini")]
    for entry in run:
        entry.model = "tiny"
    result = compare_summaries(run, paper_baseline(), 0.5, dataset_alias={"mini": "math500"},
                                   model_alias={"tiny": "Qwen3-8B"})
    rows = {row.key[3]: row for row in result.rows}
    assert rows["ddtree_tb64"].baseline_key == ("math500", "Qwen3-8B", 0.0, "ddtree_tb64")
    assert rows["ddtree_tb64"].key == ("mini", "tiny", 0.0, "ddtree_tb64") and rows["ddtree_tb64"].tau_ok
    assert rows["ddtree_best"].budget == 128 and rows["ddtree_best"].baseline_tau == 10.73
    # token identity is judged once, on the budget's own row, not again on the derived best row
    assert rows["ddtree_tb128"].lossless_ok is False and rows["ddtree_best"].lossless_ok is None
    without_model = compare_summaries(run, paper_baseline(), 0.5, dataset_alias={"mini": "math500"})
    assert all(row.tau_ok is None for row in without_model.rows)
