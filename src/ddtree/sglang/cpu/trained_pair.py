"""The trained tiny pair, on disk: committed weights when they match the recipe, else trained
once per machine and cached by recipe hash.

Why committed: training takes about 9.5 CPU-minutes, and CI (a fresh machine, 2 cores beside
busy loops, already ~10 minutes of tests) would pay it on every run, and could train a slightly
different pair on a different CPU (float results differ between CPU models). The committed
folder (<repo>/models/trained-pair: target/, drafter/, prompts.jsonl, corpus.json,
recipe.json; about 2.6 MB in bfloat16) holds the recipe hash it was trained from and the
sha256 of every file; a test recomputes the hash, so the weights cannot drift
from the recipe unnoticed. The hash covers the recipe code (pair_training.py and
byte_corpus.py, comments and docstrings excluded) and the pinned corpus manifest.

    python -m ddtree.sglang.cpu.trained_pair --retrain        # train, write the committed folder
    python -m ddtree.sglang.cpu.trained_pair --check-identical  # train again, compare bytes
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import tokenize
from pathlib import Path

import torch

from ddtree.sglang.cpu.pair_training import PROMPTS_NAME

REPO = Path(__file__).resolve().parents[4]
COMMITTED = REPO / "models" / "trained-pair"
MANIFEST_NAME = "corpus.json"
RECIPE_NAME = "recipe.json"
WEIGHT_FILES = ("target/config.json", "target/model.safetensors", "drafter/config.json",
                "drafter/model.safetensors", PROMPTS_NAME)
_RECIPE_CODE = ("pair_training.py", "byte_corpus.py")


class TrainedPairError(RuntimeError):
    """The trained pair cannot be produced here; the message says why and what to run."""


def _docstring_lines(source: bytes) -> set[int]:
    """The lines of the module's, classes' and functions' docstrings."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_without_comments(path: Path) -> bytes:
    """The module's tokens without comments, docstrings and blank lines: what computes (the
    token stream is the same on every Python version)."""
    source = path.read_bytes()
    docstrings = _docstring_lines(source)
    kept = []
    for token in tokenize.tokenize(io.BytesIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING):
            continue
        if token.type == tokenize.STRING and token.start[0] in docstrings:
            continue
        kept.append(f"{token.type}:{token.string}")
    return "\n".join(kept).encode()


def recipe_hash(manifest: Path | None = None) -> str:
    """sha256 over the recipe code and the pinned corpus manifest; the first 16 hex digits."""
    digest = hashlib.sha256()
    for name in _RECIPE_CODE:
        digest.update(name.encode() + b"\0" + code_without_comments(Path(__file__).with_name(name)) + b"\0")
    digest.update((manifest or COMMITTED / MANIFEST_NAME).read_bytes())
    return digest.hexdigest()[:16]


def file_hashes(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in WEIGHT_FILES}


def committed_state(folder: Path | None = None) -> str | None:
    """None when `folder` (the committed one by default) holds the current recipe's pair, intact;
    else what is wrong, in a line."""
    folder = COMMITTED if folder is None else folder
    record_path = folder / RECIPE_NAME
    if not record_path.is_file():
        return f"{record_path}: missing"
    record = json.loads(record_path.read_text(encoding="utf-8"))
    current = recipe_hash(folder / MANIFEST_NAME)
    if record.get("recipe_hash") != current:
        return (f"{record_path}: trained from recipe {record.get('recipe_hash')}, the code is now recipe {current}: "
                f"retrain (python -m ddtree.sglang.cpu.trained_pair --retrain) and commit")
    for name, expected in record.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{path}: missing"
        if hashlib.sha256(path.read_bytes()).hexdigest() != expected:
            return f"{path}: its sha256 differs from {record_path}'s"
    if set(record.get("files", {})) != set(WEIGHT_FILES):
        return f"{record_path}: lists {sorted(record.get('files', {}))}, expected {list(WEIGHT_FILES)}"
    return None


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train(folder: Path, manifest: Path, log=_log) -> dict:
    """Train the pair from the pinned corpus into `folder`; returns the recipe record, also
    written to folder/recipe.json."""
    from ddtree.sglang.cpu import byte_corpus

    recipe = recipe_hash(manifest)  # the code as training starts (an edit meanwhile must not count)
    record = train_from(byte_corpus.load(manifest), folder, log=log)
    record = {"recipe_hash": recipe, "corpus_python": byte_corpus.read_manifest(manifest)[0], **record}
    (folder / RECIPE_NAME).write_text(json.dumps(record, indent=1) + "\n")
    return record


def train_from(corpus, folder: Path, target_steps: int | None = None, drafter_steps: int | None = None,
               log=_log) -> dict:
    """Train the pair on `corpus` (a byte_corpus.Corpus) into `folder`; returns what was measured."""
    from ddtree.sglang.cpu import pair_training as recipe

    folder.mkdir(parents=True, exist_ok=True)
    started, cpu_start = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    load_before = os.getloadavg()

    def run() -> dict:
        with torch.random.fork_rng(devices=[]):
            target = recipe.train_target(corpus, log, target_steps)
            loss = recipe.held_out_loss(target, corpus)
            log(f"target: held-out {loss:.3f} nats/byte")
            drafter = recipe.train_drafter(target, corpus, log, drafter_steps)
        recipe.write_models(folder, target, drafter, recipe.held_out_prompts(corpus))
        return {"held_out_nats_per_byte": round(loss, 4)}

    facts = recipe.with_threads(run)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "target_steps": target_steps or recipe.TARGET_SCHEDULE.steps,
        "drafter_steps": drafter_steps or recipe.DRAFTER_SCHEDULE.steps,
        "threads": recipe.THREADS,
        **facts,
        "trained_with": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": _transformers_version(), "cpu": _cpu_model()},
        "wall_s": round(time.monotonic() - started, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime, 1),
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "files": file_hashes(folder),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def cache_root() -> Path:
    return Path(os.environ.get("DDTREE_TRAINED_PAIR_CACHE", REPO / ".cache" / "trained-pair"))


def source_folder(log=_log) -> Path:
    """A folder holding the current recipe's pair: the committed one, else this machine's cache
    (trained on first use, under a lock, which takes about 9.5 CPU-minutes)."""
    if committed_state() is None:
        return COMMITTED
    manifest = COMMITTED / MANIFEST_NAME
    if not manifest.is_file():
        raise TrainedPairError(f"{manifest}: missing (the trained pair is made from a checkout of ddtree-ops)")
    log(f"trained pair: {committed_state()}; using this machine's cache")
    cached = cache_root() / recipe_hash(manifest)
    if committed_state(cached) is not None:
        import fcntl

        cache_root().mkdir(parents=True, exist_ok=True)
        with open(cache_root() / "train.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if committed_state(cached) is not None:
                scratch = Path(tempfile.mkdtemp(dir=cache_root()))
                shutil.copy(manifest, scratch / MANIFEST_NAME)
                train(scratch, manifest, log=log)
                shutil.rmtree(cached, ignore_errors=True)
                scratch.rename(cached)
    return cached


def write_trained_pair(folder: Path, log=_log) -> dict:
    """Copy the pair into `folder`; returns the host inventory's `models:` entry for it."""
    from ddtree.sglang.cpu.pair_training import BLOCK_SIZE

    source = source_folder(log)
    folder = Path(folder)
    for name in WEIGHT_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, folder / name)
    return {"target": str(folder / "target"), "drafter": str(folder / "drafter"), "block_size": BLOCK_SIZE,
            "prompts": str(folder / PROMPTS_NAME)}


def check_identical(folder: Path | None = None) -> tuple[list[str], dict]:
    """Retrain into a temporary folder: the names of the files whose bytes differ from `folder`'s
    (the committed one by default), and the new run's record (its time and load)."""
    folder = COMMITTED if folder is None else folder
    with tempfile.TemporaryDirectory() as scratch:
        record = train(Path(scratch), folder / MANIFEST_NAME)
        differing = [name for name in WEIGHT_FILES
                     if (Path(scratch) / name).read_bytes() != (folder / name).read_bytes()]
    return differing, record


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--pin-corpus"]:
        from ddtree.sglang.cpu import byte_corpus

        COMMITTED.mkdir(parents=True, exist_ok=True)
        pinned = byte_corpus.pin()
        lines = ",\n".join(json.dumps(entry) for entry in pinned["files"])
        text = f'{{"python": {json.dumps(pinned["python"])}, "files": [\n{lines}\n]}}\n'
        (COMMITTED / MANIFEST_NAME).write_text(text)
        print(COMMITTED / MANIFEST_NAME)
        return 0
    if args == ["--retrain"]:
        print(json.dumps(train(COMMITTED, COMMITTED / MANIFEST_NAME), indent=1))
        return 0
    if args == ["--check-identical"]:
        differing, record = check_identical()
        print(f"trained again in {record['wall_s']} s ({record['cpu_s']} CPU-s, {record['threads']} thread), load "
              f"{record['loadavg_before'][0]:.1f} -> {record['loadavg_after'][0]:.1f}")
        print("identical to the committed pair" if not differing else f"differ: {', '.join(differing)}")
        return 0 if not differing else 1
    if args == ["--state"]:
        state = committed_state()
        print(state or f"{COMMITTED}: recipe {recipe_hash()}, intact")
        return 0 if state is None else 1
    print("usage: python -m ddtree.sglang.cpu.trained_pair --retrain | --check-identical | --state | --pin-corpus",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
