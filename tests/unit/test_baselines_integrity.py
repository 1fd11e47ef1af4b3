"""Reference runs with wrongly shaped or non-finite values are refused at import with one line
naming the file, request, method and field (exit 3), never written as NaN/Infinity; and the
comparison judges token identity at T=0 even when it was not measured, and lists baseline
methods the run lacks."""
from __future__ import annotations

import math

import pytest
import torch

from ddtree_ops.report.baselines import (
    compare_summaries,
    import_reference_runs,
    load_reference_run,
    paper_baseline,
)
from ddtree_ops.errors import BaselineFileError, ExitCode
from test_baselines import reference_run, save, summary


def set_field(request: int, method: str, name: str, value):
    def mutate(data):
        setattr(data["responses"][request][method], name, value)
    return mutate


def set_arg(name: str, value):
    def mutate(data):
        data["args"][name] = value
    return mutate


BROKEN = [  # (mutation, the message after "<file>: ")
    pytest.param(set_field(0, "baseline", "time_per_output_token", math.nan),
                 "responses[0]['baseline'].time_per_output_token: expected a finite number >= 0, got nan", id="nan-tpot"),
    pytest.param(set_field(0, "baseline", "time_per_output_token", math.inf),
                 "responses[0]['baseline'].time_per_output_token: expected a finite number >= 0, got inf", id="inf-tpot"),
    pytest.param(set_field(1, "dflash", "time_per_output_token", "fast"),
                 "responses[1]['dflash'].time_per_output_token: expected a finite number >= 0, got 'fast'", id="str-tpot"),
    pytest.param(set_arg("temperature", math.nan), "args.temperature: expected a finite number >= 0, got nan",
                 id="nan-temperature"),
    pytest.param(set_arg("temperature", "hot"), "args.temperature: expected a finite number >= 0, got 'hot'",
                 id="str-temperature"),
    pytest.param(set_arg("dataset", None), "args.dataset: expected a name, got None", id="no-dataset"),
    pytest.param(set_field(0, "dflash", "acceptance_lengths", [3, 0]),
                 "responses[0]['dflash'].acceptance_lengths: expected whole numbers >= 1, got 0", id="zero-length"),
    pytest.param(set_field(0, "dflash", "acceptance_lengths", [3.5, math.nan]),
                 "responses[0]['dflash'].acceptance_lengths: expected whole numbers >= 1, got 3.5", id="nan-length"),
    pytest.param(set_field(0, "dflash", "acceptance_lengths", None),
                 "responses[0]['dflash'].acceptance_lengths: expected a list of whole numbers >= 1, got None",
                 id="none-lengths"),
    pytest.param(set_field(0, "dflash", "acceptance_lengths", torch.tensor([3, 1])),
                 "responses[0]['dflash'].acceptance_lengths: expected a list of whole numbers >= 1, got a torch.int64 tensor "
                 "of shape (2,)",
                 id="tensor-lengths"),
    pytest.param(set_field(0, "dflash", "output_ids", [[1, 2, 3, 5, 6]]),
                 "responses[0]['dflash'].output_ids: expected a [1, n] integer tensor, got [[1, 2, 3, 5, 6]]",
                 id="list-ids"),
    pytest.param(set_field(1, "ddtree_tb16", "output_ids", torch.zeros(2, 5)),
                 "responses[1]['ddtree_tb16'].output_ids: expected a [1, n] integer tensor, got a torch.float32 "
                 "tensor of shape (2, 5)", id="float-ids"),
    pytest.param(set_field(0, "dflash", "num_input_tokens", 99),
                 "responses[0]['dflash'].num_input_tokens: expected a whole number from 0 to the 7 output_ids, got 99",
                 id="prompt-past-ids"),
    pytest.param(set_field(0, "dflash", "stage_times", [1, 2]),
                 "responses[0]['dflash'].stage_times: expected an object of stage -> finite seconds >= 0, got [1, 2]",
                 id="list-stage-times"),
    pytest.param(set_field(0, "dflash", "stage_times", {"verify": math.inf}),
                 "responses[0]['dflash'].stage_times: expected an object of stage -> finite seconds >= 0, "
                 "got {'verify': inf}", id="inf-stage-time"),
    # every input finite, the result not: AR's huge time over a tiny one is an infinite speedup
    pytest.param(lambda data: [setattr(r["baseline"], "time_per_output_token", 1e308) for r in data["responses"]]
                 and [setattr(r["dflash"], "time_per_output_token", 1e-300) for r in data["responses"]],
                 "dflash: speedup: expected a finite number, got inf", id="inf-speedup"),
]


@pytest.mark.parametrize("mutate, message", BROKEN)
def test_a_wrongly_shaped_or_non_finite_reference_run_is_refused_naming_file_and_field(tmp_path, mutate, message):
    data = reference_run()
    mutate(data)
    path = save(tmp_path, "broken.pt", data)
    with pytest.raises(BaselineFileError) as caught:
        import_reference_runs([path])
    assert str(caught.value) == f"{path}: {message}"
    assert caught.value.exit_code == ExitCode.CONFIG


def test_a_run_whose_requests_have_no_rounds_or_no_new_tokens_still_imports(tmp_path):
    data = reference_run()
    for response in data["responses"]:
        response["ddtree_tb16"].acceptance_lengths = []  # e.g. a stop token at prefill
    data["responses"][1]["dflash"].output_ids = torch.tensor([[1, 2, 3]])  # nothing generated
    cells = {e.method: e for e in import_reference_runs([save(tmp_path, "edge.pt", data)]).entries}
    assert cells["ddtree_tb16"].tau == 0.0 and cells["dflash"].identical_to_ar == 0.5


def test_the_baseline_file_is_strict_json():
    baseline = paper_baseline()
    baseline.entries[0].tau = math.nan  # only code could put it there: never written
    with pytest.raises(ValueError, match="not JSON compliant"):
        baseline.to_json()


def test_a_raw_pickle_gets_our_own_one_line_refusal(tmp_path):
    import pickle

    path = tmp_path / "run.pkl"
    path.write_bytes(pickle.dumps({"responses": [], "args": {}}, protocol=4))
    with pytest.raises(BaselineFileError) as caught:
        load_reference_run(path)
    assert str(caught.value) == (f"{path}: not a reference run file we can read safely (a raw pickle, not "
                                 "torch.save's archive; nothing from the file was run)")
    assert "weights_only" not in str(caught.value)


def test_token_identity_not_measured_at_t0_is_not_a_pass():
    run = [summary("baseline", 1.0, 1.0, None), summary("ddtree_tb64", 9.7, 6.5, None)]
    rows = {row.key[3]: row for row in compare_summaries(run, paper_baseline(), 0.5).rows}
    assert rows["ddtree_tb64"].tau_ok and rows["ddtree_tb64"].lossless_ok is False and not rows["ddtree_tb64"].ok
    assert rows["baseline"].lossless_ok is None  # AR is the reference itself
    assert rows["ddtree_best"].lossless_ok is None  # judged on its budget's own row
    hot = [summary("ddtree_tb64", 9.7, 6.5, None, temperature=1.0)]
    assert compare_summaries(hot, paper_baseline(), 0.5).rows[0].lossless_ok is None  # sampling: not checked


def test_baseline_methods_the_run_lacks_are_listed_as_not_compared():
    run = [summary("ddtree_tb64", 9.7, 6.5, 1.0)]
    missing = compare_summaries(run, paper_baseline(), 0.5).not_compared
    assert sorted(e.method for e in missing) == ["ddtree_tb1024", "ddtree_tb128", "ddtree_tb16", "ddtree_tb256",
                                                  "ddtree_tb32", "ddtree_tb512", "dflash"]
    assert all(e.key[:3] == ("math500", "Qwen3-8B", 0.0) for e in missing)  # the run's cell only
    other = [summary("ddtree_tb64", 9.7, 6.5, 1.0, dataset="gsm8k-mini")]
    assert compare_summaries(other, paper_baseline(), 0.5).not_compared == []  # no cell matched: nothing listed
