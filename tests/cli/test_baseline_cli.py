"""`ddtree-ops baseline import` / `baseline paper` through the real CLI entry point."""
from __future__ import annotations

import json
import os
import types

import torch

from ddtree_ops.cli.app import main


def run_file(path, dataset="gsm8k", temperature=0.0):
    def rec(tokens, lengths, tpot):
        return types.SimpleNamespace(
            output_ids=torch.tensor([[1, 2] + tokens]), num_input_tokens=2, num_output_tokens=len(tokens),
            time_to_first_token=0.0, time_per_output_token=tpot, acceptance_lengths=lengths,
            decode_rounds=len(lengths), stage_times={"verify": 1.0}, round_timestamps=[], round_trees=None,
        )

    torch.save({
        "responses": [{"baseline": rec([3, 4, 5], [1, 1, 1], 0.03), "dflash": rec([3, 4, 5], [3], 0.01),
                       "ddtree_tb32": rec([3, 4, 5], [3], 0.006)}],
        "block_size": 16, "draft_attn_implementation": "flash_attention_2", "target_attn_implementation": "sdpa",
        "args": {"dataset": dataset, "model_name_or_path": "Qwen/Qwen3-4B", "temperature": temperature},
    }, path)
    return path


def test_import_writes_a_json_baseline(tmp_path, capsys):
    out = tmp_path / "out" / "baseline.json"
    runs = [run_file(tmp_path / "a.pt"), run_file(tmp_path / "b.pt", dataset="mbpp")]
    assert main(["baseline", "import", *map(str, runs), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "ddtree-ops-baseline/1"
    cells = {(e["dataset"], e["method"]): e for e in doc["entries"]}
    assert len(cells) == 6
    tree = cells[("gsm8k", "ddtree_tb32")]
    assert tree["tau"] == 3.0 and tree["speedup"] == 5.0 and tree["model"] == "Qwen3-4B"
    assert tree["histogram"] == {"1": 0.0, "2": 0.0, "3": 1.0} and tree["identical_to_ar"] == 1.0
    assert [s["file"] for s in doc["sources"]] == ["a.pt", "b.pt"]
    assert "wrote 6 baseline entries" in capsys.readouterr().err


def test_import_prints_to_stdout_without_output(tmp_path, capsys):
    assert main(["baseline", "import", str(run_file(tmp_path / "a.pt"))]) == 0
    assert json.loads(capsys.readouterr().out)["entries"][0]["dataset"] == "gsm8k"


def test_a_malicious_file_is_refused_with_exit_3_and_nothing_is_written(tmp_path, capsys):
    sentinel = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    evil = tmp_path / "evil.pt"
    torch.save({"responses": [{"baseline": Payload()}], "args": {}}, evil)
    out = tmp_path / "baseline.json"
    out.write_text("previous baseline\n")
    good = run_file(tmp_path / "good.pt")
    assert main(["baseline", "import", str(good), str(evil), "-o", str(out)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "evil.pt: refused: the file names the global" in err
    assert not sentinel.exists()
    assert out.read_text() == "previous baseline\n"  # untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".baseline.json")] == []


def test_not_a_reference_run_and_missing_file(tmp_path, capsys):
    odd = tmp_path / "odd.pt"
    torch.save({"weights": torch.zeros(2)}, odd)
    assert main(["baseline", "import", str(odd)]) == 3
    assert "odd.pt: not a reference run: missing key 'responses'" in capsys.readouterr().err
    assert main(["baseline", "import", str(tmp_path / "none.pt")]) == 3
    assert "none.pt: no such file" in capsys.readouterr().err
    assert main(["baseline", "import", str(tmp_path)]) == 3
    assert f"{tmp_path}: a folder; give the reference run files in it" in capsys.readouterr().err


def test_paper_baseline_command(tmp_path):
    out = tmp_path / "paper.json"
    assert main(["baseline", "paper", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert any(e["method"] == "ddtree_tb1024" and e["tau"] == 10.975 for e in doc["entries"])


def test_an_unwritable_output_is_one_line_naming_the_file(tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a folder should be\n")
    out = blocker / "paper.json"
    assert main(["baseline", "paper", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddtree-ops: error: {out}: cannot write the baseline here")
    assert blocker.read_text() == "a file where a folder should be\n"


def test_an_output_that_is_a_folder_is_one_line_naming_it(tmp_path, capsys):
    folder = tmp_path / "baselines"
    folder.mkdir()
    assert main(["baseline", "paper", "-o", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ddtree-ops: error: {folder}: is a folder; name the baseline file to write (e.g. {folder / 'baseline.json'})"]
    assert list(folder.iterdir()) == []  # no temporary file left behind


def test_a_non_finite_or_wrongly_shaped_run_exits_3_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "baseline.json"
    nan = run_file(tmp_path / "nan.pt")
    data = torch.load(nan, weights_only=False)
    data["responses"][0]["baseline"].time_per_output_token = float("nan")
    torch.save(data, nan)
    shaped = run_file(tmp_path / "shaped.pt")
    data = torch.load(shaped, weights_only=False)
    data["responses"][0]["dflash"].acceptance_lengths = None
    torch.save(data, shaped)
    for path, message in [(nan, "responses[0]['baseline'].time_per_output_token: expected a finite number >= 0, got nan"),
                          (shaped, "responses[0]['dflash'].acceptance_lengths: expected a list of whole numbers >= 1, "
                                   "got None")]:
        assert main(["baseline", "import", str(path), "-o", str(out)]) == 3
        assert capsys.readouterr().err.splitlines() == [f"ddtree-ops: error: {path}: {message}"]
        assert not out.exists()


def test_a_raw_pickle_is_refused_with_our_own_line(tmp_path, capsys):
    import pickle

    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps(types.SimpleNamespace(a=1)))
    assert main(["baseline", "import", str(raw)]) == 3
    err = capsys.readouterr().err
    assert err.splitlines() == [f"ddtree-ops: error: {raw}: not a reference run file we can read safely "
                                "(a raw pickle, not torch.save's archive; nothing from the file was run)"]


def _record(output_ids, lengths):
    return types.SimpleNamespace(
        output_ids=output_ids, num_input_tokens=2, num_output_tokens=2, time_to_first_token=0.0,
        time_per_output_token=0.01, acceptance_lengths=lengths, decode_rounds=1, stage_times={},
        round_timestamps=[], round_trees=None)


def _save_run(path, responses):
    torch.save({"responses": responses, "block_size": 16,
                "args": {"dataset": "gsm8k", "model_name_or_path": "Qwen/Qwen3-4B", "temperature": 0.0}}, path)
    return path


def _refusal(path, capsys):
    out = path.parent / "baseline.json"
    assert main(["baseline", "import", str(path), "-o", str(out)]) == 3
    assert not out.exists()
    [line] = capsys.readouterr().err.splitlines()
    return line


def test_a_stride_0_view_is_refused_by_its_size_before_it_is_materialised(tmp_path, capsys):
    # 8 bytes on disk, 5M token ids (40 MB, and 24 GB at 3e9) once read out
    view = torch.zeros(1, 1, dtype=torch.int64).expand(1, 5_000_000)
    path = _save_run(tmp_path / "view.pt", [{"baseline": _record(view, [1]), "dflash": _record(view, [1])}])
    assert path.stat().st_size < 4096
    assert _refusal(path, capsys) == (f"ddtree-ops: error: {path}: responses[0]['baseline'].output_ids: "
                                      "5000000 items, past the limit of 4000000")


def test_one_record_referenced_many_times_is_counted_each_time(tmp_path, capsys):
    view = torch.zeros(1, 1, dtype=torch.int64).expand(1, 3_900_000)
    record = _record(view, [1] * 1000)
    path = _save_run(tmp_path / "shared.pt", [{"baseline": record, "dflash": record}] * 5_000)
    assert path.stat().st_size < 64 * 1024  # the pickle stores the record once
    assert _refusal(path, capsys) == (f"ddtree-ops: error: {path}: responses[8]['baseline'].output_ids: the file's "
                                      "records hold more than the limit of 64000000 items in all")
    many = _save_run(tmp_path / "many.pt", [{"baseline": _record(torch.tensor([[1, 2, 3]]), [1])}] * 100_001)
    assert _refusal(many, capsys) == f"ddtree-ops: error: {many}: responses: 100001 responses, past the limit of 100000"


def test_an_archive_that_inflates_past_the_limit_is_refused_unread(tmp_path, capsys, monkeypatch):
    import zipfile

    from ddtree_ops.report import baselines

    plain = run_file(tmp_path / "plain.pt")
    crafted = tmp_path / "deflated.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(crafted, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            target.writestr(member.filename, source.read(member))
        prefix = source.infolist()[0].filename.split("/")[0]
        target.writestr(f"{prefix}/data/99", bytes(3 << 20))  # 3 MiB of zeros deflate to a few KB
    monkeypatch.setattr(baselines, "MAX_ARCHIVE_BYTES", 2 << 20)  # the real limit is 1 GiB
    assert crafted.stat().st_size < 64 * 1024
    line = _refusal(crafted, capsys)
    assert line == (f"ddtree-ops: error: {crafted}: archive member '{prefix}/data/99': the archive inflates past "
                    f"the limit of {2 << 20} bytes ({3 << 20} bytes in this member); refused before reading it")


def test_the_shipped_paper_baseline_given_to_import_is_said_to_be_one_at_once(tmp_path):
    """What ships is a baseline already: `import` says so before torch loads, passes it
    through unchanged, and refuses it mixed with run files (exit 2, naming it)."""
    import subprocess
    import sys as _sys

    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    paper = repo / "baselines" / "ddtree-paper.json"
    probe = ("import sys; from ddtree_ops.cli.app import main; code = main(sys.argv[1:]); "
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code, file=sys.stderr)")
    out = tmp_path / "copy.json"
    done = subprocess.run([_sys.executable, "-c", probe, "baseline", "import", str(paper), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert "NO-TORCH 0" in done.stderr
    assert f"{paper} is already a baseline (nothing to import)" in done.stderr
    assert f"`ddtree-ops report --baseline {paper}`" in done.stderr
    assert json.loads(out.read_text()) == json.loads(paper.read_text())
    mixed = subprocess.run([_sys.executable, "-c", probe, "baseline", "import", str(paper), str(tmp_path / "run.pt")],
                           capture_output=True, text=True, timeout=300)
    assert "NO-TORCH 2" in mixed.stderr and f"{paper}: already a baseline, not a reference run file" in mixed.stderr
