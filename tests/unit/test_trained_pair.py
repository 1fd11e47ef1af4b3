"""The trained tiny pair's bookkeeping: the committed weights are the current recipe's, the
corpus is pinned file by file, a stale commit falls back to a per-machine cache, training is
repeatable byte for byte, and `tiny_models --trained DIR` writes the pair and its entry."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.sglang.cpu import byte_corpus, trained_pair

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_pair_is_the_current_recipes_and_intact():
    assert trained_pair.committed_state() is None, trained_pair.committed_state()
    record = json.loads((trained_pair.COMMITTED / trained_pair.RECIPE_NAME).read_text())
    assert record["recipe_hash"] == trained_pair.recipe_hash()
    assert record["threads"] == 1 and record["corpus_python"] == "3.11.7"


def test_a_changed_weight_file_or_recipe_is_named(tmp_path):
    copy = tmp_path / "pair"
    for name in (*trained_pair.WEIGHT_FILES, trained_pair.RECIPE_NAME, trained_pair.MANIFEST_NAME):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((trained_pair.COMMITTED / name).read_bytes())
    assert trained_pair.committed_state(copy) is None
    prompts = copy / trained_pair.PROMPTS_NAME
    prompts.write_bytes(prompts.read_bytes() + b"\n")
    assert trained_pair.committed_state(copy) == f"{prompts}: its sha256 differs from {copy / 'recipe.json'}'s"
    manifest = copy / trained_pair.MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes().replace(b"__future__.py", b"__past__.py"))
    assert "is now recipe" in trained_pair.committed_state(copy)
    assert "--retrain" in trained_pair.committed_state(copy)


def test_the_recipe_hash_ignores_comments_and_docstrings_not_code(tmp_path):
    one, two, three, four = (tmp_path / f"{name}.py" for name in "abcd")
    one.write_text('"""Module."""\nx = 1  # one\n\n\ndef f():\n    """Says f."""\n    return "f"\n')
    two.write_text('"""Another\nmodule text."""\n# a comment\nx = 1\ndef f():\n    """Other."""\n    return "f"  # f\n')
    three.write_text('"""Module."""\nx = 1\n\n\ndef f():\n    """Says f."""\n    return "g"\n')
    four.write_text('"""Module."""\nx = 2\n\n\ndef f():\n    """Says f."""\n    return "f"\n')
    stripped = [trained_pair.code_without_comments(path) for path in (one, two, three, four)]
    assert stripped[0] == stripped[1]
    assert len(set(stripped)) == 3  # a string that is code, and a number, count


def fake_stdlib(root: Path, count: int) -> None:
    for index in range(count):
        path = root / ("pkg" if index % 3 else "") / f"mod{index:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"def f():\n        return %d\n" % index)
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text("left out\n")
    (root / "config-3.11-x86_64-linux-gnu").mkdir()
    (root / "config-3.11-x86_64-linux-gnu" / "python-config.py").write_text("left out\n")


def test_the_corpus_is_the_pinned_files_indented_with_tabs_every_20th_held_out(tmp_path):
    fake_stdlib(tmp_path / "lib", 41)
    pinned = byte_corpus.pin(tmp_path / "lib")
    assert len(pinned["files"]) == 41 and not any("test" in p or "config-" in p for p, _ in pinned["files"])
    manifest = tmp_path / "corpus.json"
    manifest.write_text(json.dumps(pinned))
    corpus = byte_corpus.load(manifest, tmp_path / "lib")
    assert len(corpus.train) == 39 and len(corpus.held_out) == 2
    assert corpus.held_out_paths == (pinned["files"][19][0], pinned["files"][39][0])
    assert corpus.train[0].startswith(b"def f():\n\t\treturn ")


def test_a_machine_whose_stdlib_differs_is_told_which_file_in_one_line(tmp_path):
    fake_stdlib(tmp_path / "lib", 5)
    manifest = tmp_path / "corpus.json"
    manifest.write_text(json.dumps(byte_corpus.pin(tmp_path / "lib")))
    changed = tmp_path / "lib" / "pkg" / "mod01.py"
    changed.write_text("changed\n")
    with pytest.raises(byte_corpus.CorpusMismatchError) as err:
        byte_corpus.load(manifest, tmp_path / "lib")
    assert str(err.value).startswith(f"{changed}: sha256 ") and "\n" not in str(err.value)
    assert "differs from the pinned" in str(err.value)
    changed.unlink()
    with pytest.raises(byte_corpus.CorpusMismatchError, match=f"^{changed}: missing; the trained pair's corpus"):
        byte_corpus.load(manifest, tmp_path / "lib")


def test_tabs_replace_only_leading_groups_of_four_spaces():
    text = b"a = 1\n    b\n      c = '    '\n        d\n   e\n"
    assert byte_corpus.tabs_for_spaces(text) == b"a = 1\n\tb\n\t  c = '    '\n\t\td\n   e\n"


def test_a_stale_commit_is_trained_once_into_this_machines_cache(tmp_path, monkeypatch):
    trainings = []

    def fake_train(folder: Path, manifest: Path, log=None) -> dict:  # the layer above training
        trainings.append(folder)
        for name in trained_pair.WEIGHT_FILES:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(name)
        record = {"recipe_hash": trained_pair.recipe_hash(manifest), "files": trained_pair.file_hashes(folder)}
        (folder / trained_pair.RECIPE_NAME).write_text(json.dumps(record))
        return record

    committed = tmp_path / "committed"
    committed.mkdir()
    (committed / trained_pair.MANIFEST_NAME).write_bytes((trained_pair.COMMITTED / "corpus.json").read_bytes())
    monkeypatch.setattr(trained_pair, "COMMITTED", committed)
    monkeypatch.setattr(trained_pair, "train", fake_train)
    monkeypatch.setenv("DDTREE_TRAINED_PAIR_CACHE", str(tmp_path / "cache"))
    logged = []
    for attempt in range(2):
        entry = trained_pair.write_trained_pair(tmp_path / f"out{attempt}", log=logged.append)
        assert Path(entry["target"], "config.json").read_text() == "target/config.json"
    assert len(trainings) == 1
    assert logged[0] == f"trained pair: {committed / 'recipe.json'}: missing; using this machine's cache"
    assert (tmp_path / "cache" / trained_pair.recipe_hash(committed / "corpus.json")).is_dir()


@pytest.mark.slow
def test_training_is_byte_for_byte_repeatable(tmp_path):
    """Two processes, the same seeds and thread count, a few steps each (and two small groups of
    rollouts instead of 32 large ones): identical files."""
    script = (
        "import sys\nfrom pathlib import Path\n"
        "from ddtree.sglang.cpu import pair_training\n"
        "pair_training.ROLLOUT_GROUPS, pair_training.ROLLOUT_GROUP = 2, 32\n"
        "from ddtree.sglang.cpu.byte_corpus import Corpus\nfrom ddtree.sglang.cpu.trained_pair import train_from\n"
        f"files = sorted(Path({str(REPO / 'src' / 'ddtree')!r}).glob('*.py'))\n"
        "texts = tuple(f.read_bytes() for f in files)\n"
        "corpus = Corpus(texts[3:], texts[:3], tuple(f.name for f in files[:3]))\n"
        "train_from(corpus, Path(sys.argv[1]), target_steps=3, drafter_steps=2, log=lambda line: None)\n"
    )
    outputs = []
    for run in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / run)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append({name: (tmp_path / run / name).read_bytes() for name in trained_pair.WEIGHT_FILES})
    assert outputs[0] == outputs[1]
    assert outputs[0]["target/model.safetensors"] != (trained_pair.COMMITTED / "target/model.safetensors").read_bytes()


@pytest.mark.slow
def test_tiny_models_trained_writes_the_pair_and_prints_its_models_entry(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddtree.sglang.cpu.tiny_models", "--trained", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout.strip().splitlines()[-1])
    assert entry == {"target": str(tmp_path / "m" / "target"), "drafter": str(tmp_path / "m" / "drafter"),
                     "block_size": 16, "prompts": str(tmp_path / "m" / "prompts.jsonl")}
    for name in trained_pair.WEIGHT_FILES:
        assert (tmp_path / "m" / name).read_bytes() == (trained_pair.COMMITTED / name).read_bytes()
    prompts = [json.loads(line) for line in Path(entry["prompts"]).read_text().splitlines()]
    assert len(prompts) == 16 and all(48 <= len(p["input_ids"]) <= 160 for p in prompts)
    assert len({p["source"].split("@")[0] for p in prompts}) == 16  # each from its own held-out file
    bad = subprocess.run([sys.executable, "-m", "ddtree.sglang.cpu.tiny_models", "--trained"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: python -m ddtree.sglang.cpu.tiny_models")
