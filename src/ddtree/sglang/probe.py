"""Run in a host's Python environment: is the plugin discoverable, and do its hooks take?

    python -m ddtree.sglang.probe [--allow-gate-findings] [--gate-report -]

Prints one JSON object. Used by `ddtree-ops deploy` (from a fresh interpreter after
installing), by the `plugin` smoke stage and by the tests. It runs SGLang's own
`load_plugins()` with `sglang/__init__.py` bypassed (that file imports the whole frontend,
which needs GPU-only dependencies) and DDTREE_ENABLE=1, DDTREE_STRICT=0, so that it can
report every hook instead of stopping at the first.

`--gate-report -` reads the gate's report on this installation from stdin instead of checking
it again: the installer passes the report it made moments before, with the same release's
gate, under the same host lock (a second check costs about half a second and would find the
same). The output's `gate_from` says which it was: "probe" or "caller".

verdict: "hooks-applied"  every hook applied, every name checked at runtime matched;
         "static-only"    SGLang's speculative modules cannot import here (a third-party
                          dependency is missing, e.g. on a CPU host): the entry point ran,
                          the hooks were registered, and the static structure check passed;
         "failed"         anything else (reasons say what).
exit 0 unless the verdict is "failed" (then 1).
"""
from __future__ import annotations

import argparse
import gc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from enum import Enum
from typing import Any

from ddtree.sglang.config import ENV_SGLANG_PLUGINS, PLUGIN_NAME, plugins_filter_problem

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_VALUE = "ddtree.sglang.plugin:register"


class Verdict(Enum):
    HOOKS_APPLIED = "hooks-applied"
    STATIC_ONLY = "static-only"
    FAILED = "failed"


class GatedImports:
    """A finder, first on sys.meta_path, for the SGLang files the gate read (`checked`:
    {path relative to the sglang package: sha256}): each is read once, its sha256 compared
    with what the gate read, and those very bytes compiled (never a cached .pyc). A file
    changed after the gate ran, whenever, is refused instead of run: there is no window
    between the check and the import. Other SGLang files import as usual (the gate does not
    check them, so it vouches for nothing there)."""

    def __init__(self, package_dir: str, checked: dict[str, str]):
        self.root, self.checked, self.refused = os.path.realpath(package_dir), dict(checked), []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith("sglang."):
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.has_location or not spec.origin:
            return spec
        rel = os.path.relpath(os.path.realpath(spec.origin), self.root).replace(os.sep, "/")
        if rel in self.checked:
            spec.loader = _GatedLoader(fullname, spec.origin, self.checked[rel], self)
        return spec


class _GatedLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, expected: str, finder: GatedImports):
        super().__init__(fullname, path)
        self.expected, self.finder = expected, finder

    def get_code(self, fullname: str) -> Any:
        import hashlib

        from ddtree.sglang.manifest import read_plain_file

        try:
            data = read_plain_file(self.path)
        except OSError as err:
            data, digest = None, f"unreadable ({err.strerror or err})"
        else:
            digest = hashlib.sha256(data).hexdigest()
        if digest != self.expected:
            why = (f"{self.path}: changed since the gate checked it (sha256 {digest[:16]}..., the gate read "
                   f"{self.expected[:16]}...): not imported")
            self.finder.refused.append(why)
            raise ImportError(why, name=fullname, path=self.path)
        return compile(data, self.path, "exec", dont_inherit=True)


def gate_imports(gate: dict[str, Any]) -> GatedImports | None:
    """Install GatedImports for the files `gate` (a report) read; None when it names none."""
    checked = gate.get("checked_sha256") or gate.get("file_sha256") or {}
    if not gate.get("package_dir") or not isinstance(checked, dict) or not checked:
        return None
    finder = GatedImports(str(gate["package_dir"]), checked)
    sys.meta_path.insert(0, finder)
    return finder


def bypass_sglang_init() -> bool:
    """Register a bare `sglang` package so `sglang.srt.*` imports skip sglang/__init__.py."""
    if "sglang" in sys.modules:
        return True
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = None
    sys.modules["sglang"] = package
    return True


def entry_point_info() -> dict[str, Any]:
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not found:
        return {"found": False}
    ep = found[0]
    return {
        "found": True,
        "value": ep.value,
        "dist": ep.dist.name if ep.dist else None,
        "count": len(found),
    }


def classify(
    entry_point: dict[str, Any], gate: dict[str, Any], self_check: dict[str, Any] | None,
    load_error: str | None, *, allow_gate_findings: bool, plugins_filter: str | None = None,
    refused_imports: list[str] | None = None,
) -> tuple[Verdict, list[str]]:
    """Pure: the verdict and its reasons from the probe's observations (plugins_filter: the
    raw SGLANG_PLUGINS this environment gives SGLang's processes, None when unset;
    refused_imports: gated files that changed after the gate read them)."""
    reasons: list[str] = list(refused_imports or [])
    filtered_out = plugins_filter_problem(plugins_filter)
    if filtered_out:
        reasons.append(filtered_out)
    if not entry_point.get("found"):
        reasons.append(f"entry point {PLUGIN_GROUP}:{PLUGIN_NAME} not discoverable")
    elif entry_point.get("value") != PLUGIN_VALUE:
        reasons.append(f"entry point points at {entry_point.get('value')}, expected {PLUGIN_VALUE}")
    elif entry_point.get("count", 1) != 1:
        reasons.append(f"{entry_point['count']} distributions declare {PLUGIN_GROUP}:{PLUGIN_NAME}")
    # The probe judges the structure; whether drifted hashes may deploy is the installer's call.
    if not gate.get("structure_ok", gate.get("ok")) and not allow_gate_findings:
        reasons += [f"gate: {f['file']}: {f['kind']}: {f['detail']}" for f in gate.get("findings", [])
                    if f.get("evidence", "structure") == "structure"]
        if "error" in gate:
            reasons.append(f"gate: {gate['error']}")
    if load_error:
        reasons.append(f"load_plugins() raised: {load_error}")
    if self_check is None:
        reasons.append("the plugin's self-check did not run (register() was not called by load_plugins)")
        return Verdict.FAILED, reasons
    from ddtree.sglang.selfcheck import HookState  # lazy, like probe()'s other ddtree imports

    missing: list[str] = []
    for hook in self_check["hooks"]:
        if hook["state"] == HookState.APPLIED.value:
            continue
        if hook["state"] == HookState.UNRESOLVABLE.value and hook.get("missing_dependency"):
            missing.append(hook["missing_dependency"])
            continue
        reasons.append(f"{hook['hook_id']} {hook['target']}: {hook['state']} ({hook['detail']})")
    reasons += [f"{n['label']}: {n['detail']}" for n in self_check["names"] if not n["ok"]]
    if reasons:
        return Verdict.FAILED, reasons
    if missing:
        unique = ", ".join(sorted(set(missing)))
        return Verdict.STATIC_ONLY, [f"SGLang's speculative modules cannot import here (missing: {unique}); static checks only"]
    return Verdict.HOOKS_APPLIED, []


def import_refusal(gate: dict[str, Any], *, allow_gate_findings: bool, require_gate_ok: bool) -> str | None:
    """Why SGLang's files must not be imported at all (None: they may): importing runs their
    code, so files the gate did not accept are never imported. The structure must hold (unless
    --allow-gate-findings: deploy --force); with `require_gate_ok` (a gated deploy) the hashes
    must also be pinned or qualified."""
    if allow_gate_findings:
        return None
    if not gate.get("structure_ok", gate.get("ok")):
        return "the gate found SGLang's structure changed: its files were not imported"
    if require_gate_ok and not gate.get("ok"):
        return f"the gate did not accept SGLang's files ({gate.get('verdict', 'not ok')}): they were not imported"
    return None


def probe(*, allow_gate_findings: bool = False, gate_report: dict[str, Any] | None = None,
          require_gate_ok: bool = False) -> dict[str, Any]:
    """`gate_report`: the gate's report (`GateReport.to_dict()`) on this installation, made by
    the caller with this same release; None: the probe runs the gate itself. Nothing of SGLang
    is imported unless the gate accepted it (`import_refusal`)."""
    os.environ["DDTREE_ENABLE"] = "1"
    os.environ["DDTREE_STRICT"] = "0"
    from ddtree.sglang.gate import collector_paused, find_package_dir, run_gate

    package_dir = find_package_dir()
    result: dict[str, Any] = {"python": sys.executable, "sglang_dir": str(package_dir) if package_dir else None}
    result["entry_point"] = entry_point_info()
    if package_dir is None:
        result["gate"] = {"ok": False, "error": "sglang not found", "findings": []}
        result["verdict"], result["reasons"] = Verdict.FAILED.value, ["sglang is not installed in this environment"]
        return result
    if gate_report is None:
        result["gate"], result["gate_from"] = run_gate(package_dir).to_dict(), "probe"
    else:
        result["gate"], result["gate_from"] = gate_report, "caller"
    refusal = import_refusal(result["gate"], allow_gate_findings=allow_gate_findings, require_gate_ok=require_gate_ok)
    checked_dir = result["gate"].get("package_dir")
    if refusal is None and checked_dir and os.path.realpath(checked_dir) != os.path.realpath(package_dir):
        refusal = (f"the gate checked sglang at {checked_dir}, but this interpreter imports it from {package_dir}:"
                   " its files were not imported")
    if refusal is not None:
        _, reasons = classify(result["entry_point"], result["gate"], None, None, allow_gate_findings=False,
                              plugins_filter=os.environ.get(ENV_SGLANG_PLUGINS))
        result["self_check"], result["verdict"] = None, Verdict.FAILED.value
        result["reasons"] = [r for r in reasons if r.startswith("gate: ")] + [refusal]
        return result

    gated = gate_imports(result["gate"])  # before anything of SGLang is imported
    bypass_sglang_init()
    load_error = None
    try:
        # SGLang and the plugin import torch here: a million objects that every full collection
        # during the imports would walk again
        with collector_paused():
            from sglang.srt.plugins import load_plugins

            load_plugins()
    except Exception as err:  # noqa: BLE001 - reported as a reason
        load_error = f"{type(err).__name__}: {err}"
    from ddtree.sglang import selfcheck

    report = selfcheck.LAST_REPORT.to_dict() if selfcheck.LAST_REPORT is not None else None
    result["self_check"] = report
    verdict, reasons = classify(
        result["entry_point"], result["gate"], report, load_error, allow_gate_findings=allow_gate_findings,
        plugins_filter=os.environ.get(ENV_SGLANG_PLUGINS), refused_imports=gated.refused if gated else None,
    )
    result["verdict"], result["reasons"] = verdict.value, reasons
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.sglang.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--allow-gate-findings", action="store_true", help="deploy --force: do not fail on gate findings")
    parser.add_argument("--gate-report", choices=["-"], help="read the caller's gate report (JSON) from stdin")
    parser.add_argument("--require-gate-ok", action="store_true",
                        help="a gated deploy: import nothing unless the hashes are pinned or qualified")
    args = parser.parse_args(argv)
    gate_report = None
    if args.gate_report:
        try:
            gate_report = json.loads(sys.stdin.read())
        except ValueError:  # not JSON: the same one-line usage error as a wrong shape
            gate_report = None
        if not isinstance(gate_report, dict) or "structure_ok" not in gate_report:
            parser.error("--gate-report: stdin holds no gate report (a JSON object with structure_ok)")
    result = probe(allow_gate_findings=args.allow_gate_findings, gate_report=gate_report,
                   require_gate_ok=args.require_gate_ok)
    print(json.dumps(result))
    return 1 if result["verdict"] == Verdict.FAILED.value else 0


if __name__ == "__main__":
    exit_code = main()
    gc.freeze()  # skip the shutdown's walk over SGLang's and torch's objects (~0.6 s of CPU)
    raise SystemExit(exit_code)
