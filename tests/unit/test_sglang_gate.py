"""The compatibility gate against the real sglang==0.5.23 files (pip install --no-deps)."""
from __future__ import annotations

import ast
import inspect
import json
import textwrap
from pathlib import Path

import pytest

from ddtree.sglang import gate
from ddtree.sglang.gate import FindingKind, run_gate
from ddtree_ops.hostside.sglang_install import REFUSAL_FINDINGS_SHOWN, entry_point_refusal, foreign_entry_points, gate_refusal
from ddtree.sglang.manifest import (
    NameKind,
    find_definition,
    signature_from_ast,
    signature_from_callable,
)
from ddtree.sglang.manifests import SUPPORTED, manifest_for
from sglang_plugin.dist import SGLANG_VERSION, copy_gate_files, sglang_package_dir

# The files the spec says we must pin (hooked or subclassed, plus the verify machinery).
SPEC_PINNED = {
    "srt/arg_groups/speculative_hook.py",
    "srt/speculative/spec_info.py",
    "srt/speculative/dflash_utils.py",
    "srt/speculative/dflash_worker_v2.py",
    "srt/speculative/dflash_info.py",
    "srt/speculative/dflash_info_v2.py",
    "srt/speculative/eagle_utils.py",
    "srt/speculative/eagle_worker_common.py",
    "srt/speculative/spec_utils.py",
    "kernels/ops/speculative/reconstruct_tree.py",
    "srt/plugins/hook_registry.py",
    "srt/model_executor/runner/decode_cuda_graph_runner.py",
    "srt/layers/attention/flashinfer_backend.py",
    "srt/layers/attention/triton_backend.py",
}


@pytest.fixture(scope="module")
def real_package() -> Path:
    return sglang_package_dir()


@pytest.fixture
def copied_package(tmp_path) -> Path:
    return copy_gate_files(tmp_path / "site-packages")


@pytest.mark.slow
def test_real_0_5_23_passes_the_gate(real_package):
    report = run_gate(real_package)
    assert report.version == SGLANG_VERSION
    assert report.manifest_version == SGLANG_VERSION
    assert report.findings == []
    assert report.ok


def test_manifest_pins_every_hooked_and_subclassed_file():
    manifest = manifest_for(SGLANG_VERSION)
    assert manifest is not None
    assert SPEC_PINNED <= set(manifest.file_sha256)
    assert all(len(digest) == 64 for digest in manifest.file_sha256.values())
    hooked = {r.qualname for r in manifest.names}
    assert {"_handle_dflash", "SpeculativeAlgorithm.create_worker", "resolve_dflash_verify_mask_policy",
            "eagle_sample", "move_accept_tokens_to_target_kvcache", "DFlashWorkerV2.__init__"} <= hooked


def test_spec_facts_hold_in_the_real_files(real_package):
    """What the plan relies on, read from 0.5.23 itself: DFLASH reserves 2N slots, the
    hook registry only logs unresolvable targets, eagle_sample takes an irregular tree."""
    info_v2 = (real_package / "srt/speculative/dflash_info_v2.py").read_text()
    assert "reserve = 2 * block_size" in info_v2
    registry = (real_package / "srt/plugins/hook_registry.py").read_text()
    assert 'logger.exception("Failed to apply hooks to %s", target)' in registry
    group = ast.parse((real_package / "srt/plugins/__init__.py").read_text())
    assert ast.literal_eval(find_definition(group, "GENERAL_PLUGINS_GROUP").value) == "sglang.srt.plugins"


@pytest.mark.slow
def test_a_tampered_hooked_file_is_refused_naming_it(copied_package):
    worker = copied_package / "srt/speculative/dflash_worker_v2.py"
    worker.write_text(worker.read_text() + "\n# local patch\n")
    report = run_gate(copied_package)
    assert not report.ok and report.structure_ok and not report.pinned
    assert [(f.kind, f.file) for f in report.findings] == [(FindingKind.HASH_MISMATCH, str(worker))]
    assert "dflash_worker_v2.py: hash-mismatch: sha256" in report.findings[0].line()
    assert report.findings[0].detail.endswith("; comments or formatting only (its code is the pinned code)")
    assert report.code_changed == []
    worker.write_text(worker.read_text() + "LOCAL_PATCH = 1\n")  # code, outside the hooked definitions
    report = run_gate(copied_package)
    assert report.findings[0].detail.endswith("; changed only outside the hooked definitions")
    assert report.code_changed == ["srt/speculative/dflash_worker_v2.py"]


@pytest.mark.slow
def test_a_changed_signature_is_named_with_its_qualname(copied_package):
    hook_file = copied_package / "srt/arg_groups/speculative_hook.py"
    text = hook_file.read_text()
    assert "def _handle_dflash(server_args: ServerArgs) -> None:" in text
    hook_file.write_text(text.replace(
        "def _handle_dflash(server_args: ServerArgs) -> None:",
        "def _handle_dflash(server_args: ServerArgs, strict: bool) -> None:",
    ))
    findings = run_gate(copied_package).findings
    assert [(f.kind, f.file) for f in findings] == [
        (FindingKind.HASH_MISMATCH, str(hook_file)),
        (FindingKind.NAME_MISMATCH, str(hook_file)),
    ]
    assert findings[1].detail == "_handle_dflash: signature (server_args, strict), expected (server_args)"


@pytest.mark.slow
def test_a_removed_name_in_an_unpinned_file_is_still_caught(copied_package):
    overrides = copied_package / "srt/arg_groups/overrides.py"
    overrides.write_text(overrides.read_text().replace("def declare_resolution(", "def declare_resolution_v2("))
    findings = run_gate(copied_package).findings
    assert [(f.kind, f.detail) for f in findings] == [
        (FindingKind.NAME_MISMATCH, "declare_resolution: not defined")
    ]


@pytest.mark.slow
def test_a_file_edited_between_two_gate_runs_in_one_process_is_read_anew(copied_package):
    """The gate keeps what it parsed for the next run in the process: an edit, same path,
    same size even, must still be seen."""
    assert run_gate(copied_package).ok
    overrides = copied_package / "srt/arg_groups/overrides.py"
    text = overrides.read_text()
    overrides.write_text(text.replace("def declare_resolution(", "def declare_resolutioX("))
    assert len(overrides.read_text()) == len(text)
    assert [f.detail for f in run_gate(copied_package).findings] == ["declare_resolution: not defined"]
    overrides.write_text(text)
    assert run_gate(copied_package).ok


@pytest.mark.slow
def test_an_unknown_version_is_refused(copied_package):
    metadata = copied_package.parent / f"sglang-{SGLANG_VERSION}.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace(f"Version: {SGLANG_VERSION}", "Version: 0.5.24", 1))
    report = run_gate(copied_package)
    assert report.version == "0.5.24"
    assert [f.kind for f in report.findings] == [FindingKind.UNKNOWN_VERSION]
    assert report.findings[0].detail == "sglang 0.5.24 is not pinned (shipped manifests: 0.5.23)"
    assert (report.structure_ok, report.pinned, report.ok) == (True, False, False)
    assert report.verdict() == "structure ok, version not pinned, not qualified"


@pytest.mark.slow
def test_a_missing_file_is_refused_once(copied_package):
    """The file is both pinned and read for names: one finding, not one per check."""
    (copied_package / "srt/speculative/eagle_utils.py").unlink()
    findings = run_gate(copied_package).findings
    assert [(f.kind, Path(f.file).name) for f in findings] == [(FindingKind.MISSING_FILE, "eagle_utils.py")]


@pytest.mark.slow
def test_a_refusal_leads_with_the_version_and_stays_short(copied_package):
    """An unknown version whose files are missing: one line that says the version and the
    structure first, names the hooks, and shows only the first few findings."""
    metadata = copied_package.parent / f"sglang-{SGLANG_VERSION}.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace(f"Version: {SGLANG_VERSION}", "Version: 0.5.99", 1))
    missing = sorted(SPEC_PINNED)[:6]
    for rel in missing:
        (copied_package / rel).unlink()
    report = run_gate(copied_package)
    refusal = gate_refusal(report.to_dict())
    others = [f for f in report.findings if f.kind is not FindingKind.UNKNOWN_VERSION]
    assert [f.kind for f in others] == [FindingKind.MISSING_FILE] * len(others) and len(others) >= 6
    assert refusal.startswith(f"sglang 0.5.99: structure differs from sglang 0.5.23 in {len(others)} hook(s): ")
    assert "\n" not in refusal and refusal.endswith("--force deploys anyway (recorded)")
    assert sum(str(copied_package / rel) in refusal for rel in missing) == REFUSAL_FINDINGS_SHOWN
    assert f"(+{len(others) - REFUSAL_FINDINGS_SHOWN} more;" in refusal


@pytest.mark.slow
def test_version_falls_back_to_the_version_file(copied_package):
    for dist in copied_package.parent.glob("sglang-*.dist-info"):
        (dist / "METADATA").unlink()
    assert gate.read_installed_version(copied_package) == SGLANG_VERSION


@pytest.mark.slow
def test_cli_exit_codes_and_json(copied_package, capsys):
    assert gate.main(["--package-dir", str(copied_package), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    spec_info = copied_package / "srt/speculative/spec_info.py"
    spec_info.write_text(spec_info.read_text() + "#")
    assert gate.main(["--package-dir", str(copied_package)]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and f"{spec_info}: hash-mismatch" in out
    assert gate.main(["--package-dir", str(copied_package.parent / "nowhere")]) == 2


SIGNATURE_CASES = [
    ("def f(a, b=1, *args, c, d=2, **kw): pass", "(a, b=, *args, c, d=, **kw)", False),
    ("def f(a, /, b, *, c): pass", "(a, /, b, *, c)", False),
    ("def f(self, x, /, y=0): pass", "(x, /, y=)", True),
    ("def f(self, *, target_hidden, cache_loc=None): pass", "(*, target_hidden, cache_loc=)", True),
    ("def f(): pass", "()", False),
]


@pytest.mark.parametrize("source, expected, drop_first", SIGNATURE_CASES)
def test_static_and_runtime_signatures_agree(source, expected, drop_first):
    node = ast.parse(source).body[0]
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), "<case>", "exec"), namespace)
    assert signature_from_ast(node, drop_first=drop_first) == expected
    assert signature_from_callable(namespace["f"], drop_first=drop_first) == expected


def test_every_supported_manifest_is_consistent():
    for version, manifest in SUPPORTED.items():
        assert manifest.sglang_version == version
        for required in manifest.names:
            callable_kind = required.kind in (NameKind.FUNCTION, NameKind.METHOD, NameKind.CLASSMETHOD)
            assert (required.signature is not None) == callable_kind, required.label
            assert required.module.startswith("sglang."), required.label
    assert inspect.isfunction(gate.main)


def test_an_environment_with_ddtree_ops_installed_is_refused_with_what_to_do():
    """This venv has ddtree-ops installed (editable), whose own metadata declares the entry
    point: deploy must not add a second one, and says the installed package is the plugin."""
    foreign = foreign_entry_points()
    assert foreign == ["ddtree.sglang.plugin:register (ddtree-ops)"]
    refusal = entry_point_refusal(foreign)
    assert refusal.startswith("entry point sglang.srt.plugins:ddtree already declared by ddtree.sglang.plugin:register")
    assert "ddtree-ops itself is installed in this environment" in refusal and "DDTREE_ENABLE=1" in refusal
    assert "ddtree-ops itself" not in entry_point_refusal(["other.plugin:register (someone-else)"])


# ---------------------------------------------------------------- bytecode caches


def _pyc(source_path: Path, code, *, flags: int = 0, header: bytes | None = None) -> bytes:
    """A .pyc as importlib writes it: magic, flags, then mtime+size of the source (or a hash), code."""
    import importlib.util
    import marshal

    if header is None:
        stat = source_path.stat()
        header = (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    return importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + header + marshal.dumps(code)


def _tampered_code(path: Path):
    """What an attacker would run instead: the file's code with one more statement."""
    return compile(path.read_bytes() + b"\nTAMPERED = True\n", str(path), "exec", dont_inherit=True)


def _code_python_runs(path: Path):
    """The code object the import system would execute for `path` (cache or source), without running it."""
    import importlib.machinery
    import sys

    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return importlib.machinery.SourceFileLoader("gated", str(path)).get_code("gated")
    finally:
        sys.dont_write_bytecode = previous


HOOKED = "srt/speculative/spec_info.py"


@pytest.mark.slow
def test_fresh_bytecode_caches_pass_and_tampered_ones_are_found(copied_package):
    import importlib.util
    import py_compile

    manifest = SUPPORTED[SGLANG_VERSION]
    for rel in set(manifest.file_sha256) | {r.file for r in manifest.names}:
        py_compile.compile(str(copied_package / rel), doraise=True)  # what pip or Python writes
    assert run_gate(copied_package).findings == []

    hooked = copied_package / HOOKED
    cache = Path(importlib.util.cache_from_source(str(hooked)))
    honest = cache.read_bytes()
    tampered = _tampered_code(hooked)
    cache.write_bytes(_pyc(hooked, tampered))  # header matches the source's mtime and size
    assert "TAMPERED" in _code_python_runs(hooked).co_names  # Python would run it
    assert hooked.read_bytes() == (copied_package / HOOKED).read_bytes()  # the source still passes its hash
    findings = run_gate(copied_package).findings
    assert [(f.kind, f.file) for f in findings] == [(FindingKind.BYTECODE_MISMATCH, str(cache))]
    assert f"would run instead of {HOOKED} is not compiled from it" in findings[0].detail

    # A checked hash-based cache whose source hash is right, and an unchecked one: both run.
    source_hash = importlib.util.source_hash(hooked.read_bytes())
    for flags, header in ((0b11, source_hash), (0b01, b"\0" * 8)):
        cache.write_bytes(_pyc(hooked, tampered, flags=flags, header=header))
        assert "TAMPERED" in _code_python_runs(hooked).co_names
        assert [f.kind for f in run_gate(copied_package).findings] == [FindingKind.BYTECODE_MISMATCH]

    # A stale cache (another mtime) or a checked one with the wrong hash never runs: no finding.
    for pyc in (_pyc(hooked, tampered, header=b"\1\0\0\0\0\0\0\0"), _pyc(hooked, tampered, flags=0b11, header=b"\0" * 8)):
        cache.write_bytes(pyc)
        assert "TAMPERED" not in _code_python_runs(hooked).co_names
        assert run_gate(copied_package).findings == []
    cache.write_bytes(honest)
    assert run_gate(copied_package).findings == []


@pytest.mark.slow
def test_a_tampered_optimized_cache_and_an_unreadable_one_are_found(copied_package):
    import importlib.util

    hooked = copied_package / HOOKED
    optimized = Path(importlib.util.cache_from_source(str(hooked), optimization="1"))  # what python -O runs
    optimized.parent.mkdir(exist_ok=True)
    optimized.write_bytes(_pyc(hooked, _tampered_code(hooked)))
    assert [(f.kind, f.file) for f in run_gate(copied_package).findings] == [(FindingKind.BYTECODE_MISMATCH, str(optimized))]
    optimized.write_bytes(_pyc(hooked, compile(hooked.read_bytes(), str(hooked), "exec", dont_inherit=True, optimize=1)))
    assert run_gate(copied_package).findings == []
    optimized.write_bytes(_pyc(hooked, None)[:16] + b"\xff\x00garbage")  # a fresh header, no valid code
    assert [f.kind for f in run_gate(copied_package).findings] == [FindingKind.BYTECODE_MISMATCH]


@pytest.mark.slow
def test_the_gate_reads_each_file_once_and_reports_what_it_read(copied_package, monkeypatch):
    """Every check of one run sees the same bytes (#49 item 6): a file is read once, hashed,
    parsed and compiled from those bytes, and `checked_sha256` holds what was read: every
    pinned and named file and every file the worker's facts read (logits_processor.py among
    them), as the probe then imports them."""
    import hashlib
    import os

    from ddtree.sglang import manifest

    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1])
    report = run_gate(copied_package)
    monkeypatch.undo()
    sources = [p for p in opened if p.endswith(".py")]
    assert sources and len(sources) == len(set(sources)), [p for p in sources if sources.count(p) > 1][:3]
    assert report.ok and set(report.file_sha256) <= set(report.checked_sha256)
    assert "srt/layers/logits_processor.py" in report.checked_sha256
    for rel, digest in report.checked_sha256.items():
        assert hashlib.sha256((copied_package / rel).read_bytes()).hexdigest() == digest, rel
    assert report.to_dict()["checked_sha256"] == report.checked_sha256
    assert manifest.SOURCE_READ_MAX >= max((copied_package / r).stat().st_size for r in report.checked_sha256)


def test_a_fifo_or_an_oversized_file_at_a_pinned_path_is_a_finding_not_a_hang(copied_package, monkeypatch):
    import os

    from ddtree.sglang import manifest

    import threading

    pinned = copied_package / "srt/speculative/spec_info.py"
    pinned.unlink()
    os.mkfifo(pinned)  # opened for reading, a FIFO with no writer would block for ever
    reports: list[gate.GateReport] = []
    worker = threading.Thread(target=lambda: reports.append(run_gate(copied_package)), daemon=True)
    worker.start()
    worker.join(timeout=120)  # a wide margin: the gate takes about a second
    assert reports, "the gate blocked on a FIFO at a pinned path"
    report = reports[0]
    assert f"{pinned}: missing-file: not a plain file" in [f.line() for f in report.findings]
    pinned.unlink()
    pinned.write_bytes(b"x = 1\n" * 100)
    monkeypatch.setattr(manifest, "SOURCE_READ_MAX", 64)
    report = run_gate(copied_package)
    assert any(f.line().startswith(f"{pinned}: missing-file: larger than 64 bytes") for f in report.findings)


@pytest.mark.parametrize("text", ["x = " + "+".join(["a"] * 200_000), "x = " + "-" * 200_000 + "a"])
def test_a_checked_file_nested_past_the_parser_is_a_finding_not_a_crash(copied_package, text):
    """A hostile host's 'SGLang file' that ast.parse cannot take (RecursionError, MemoryError)
    is an unparsable file like any other, on the host and where the operator side reads it."""
    named = copied_package / "srt/speculative/dflash_utils.py"
    named.write_text(text + "\n")
    report = run_gate(copied_package)
    assert not report.structure_ok
    lines = [f.line() for f in report.findings]
    assert f"{named}: unparsable: nested too deep to parse" in lines, lines
    assert str(named) in {f.file for f in report.findings if f.kind is FindingKind.HASH_MISMATCH}


def test_version_files_a_host_can_forge_read_as_no_version(copied_package):
    """A dist-info METADATA that is a FIFO, a _version.py that does not parse or whose
    __version__ is not a literal: the version is unreadable (a finding), never a hang or a crash."""
    import os

    metadata = next(copied_package.parent.glob("sglang-*.dist-info")) / "METADATA"
    metadata.unlink()
    os.mkfifo(metadata)
    for text in ("__version__ = (", "__version__ = make_version()", "__version__ = " + "(" * 150 + "1" + ")" * 150):
        (copied_package / "_version.py").write_text(text + "\n")
        assert gate.read_installed_version(copied_package) is None, text
    (copied_package / "_version.py").write_text('__version__ = "0.5.23"\n')
    assert gate.read_installed_version(copied_package) == "0.5.23"
