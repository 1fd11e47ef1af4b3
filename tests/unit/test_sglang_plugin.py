"""The plugin inside SGLang's real plugin machinery (sglang==0.5.23 files, CPU).

On CPU only `sglang.srt.plugins*` and `sglang.srt.environ` import (with sglang/__init__.py
bypassed), so SGLang's own load_plugins() runs our register() for real; the three hook
targets cannot import here and the self-check must say so precisely.
"""
from __future__ import annotations

import json

import pytest

from sglang_plugin.dist import BYPASS_SGLANG_INIT, run_python

TARGETS = (
    "sglang.srt.arg_groups.speculative_hook._handle_dflash",
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker",
    "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy",
)

LOAD_AND_REPORT = BYPASS_SGLANG_INIT + """
import json
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from ddtree.sglang import selfcheck
error = None
try:
    load_plugins()
except Exception as err:
    error = f"{type(err).__name__}: {err}"
ours = {t: [(ht.name, getattr(h, "__module__", ""), src.plugin_name if src else None, src.dist_name if src else None)
            for ht, h, src in hooks] for t, hooks in HookRegistry._hooks.items()}
wrapped = getattr(HookRegistry.__dict__["apply_hooks"].__func__, "_ddtree_self_check", False)
report = selfcheck.LAST_REPORT.to_dict() if selfcheck.LAST_REPORT else None
print(json.dumps({"error": error, "hooks": ours, "wrapped": wrapped, "report": report}))
"""


def _load(env: dict[str, str]) -> dict:
    done = run_python(LOAD_AND_REPORT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_entry_point_is_discoverable_from_a_fresh_interpreter():
    done = run_python(
        "from importlib.metadata import entry_points\n"
        "eps = [ep for ep in entry_points(group='sglang.srt.plugins') if ep.name == 'ddtree']\n"
        "fn = eps[0].load()\n"
        "print(len(eps), eps[0].value, eps[0].dist.name, fn.__module__, fn.__name__)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "ddtree.sglang.plugin:register", "ddtree-ops", "ddtree.sglang.plugin", "register"]


@pytest.mark.slow
def test_sglang_load_plugins_runs_register_and_the_self_check_names_each_target():
    result = _load({"DDTREE_ENABLE": "1", "DDTREE_STRICT": "0"})
    assert result["error"] is None
    for target in TARGETS:
        # Registered through SGLang's own loader: the source is our entry point and dist.
        [(hook_type, module, plugin, dist)] = result["hooks"][target]
        assert (module, plugin, dist) == ("ddtree.sglang.hooks", "ddtree", "ddtree-ops")
    assert [h["target"] for h in result["report"]["hooks"]] == list(TARGETS)
    states = {h["target"]: (h["state"], h["missing_dependency"]) for h in result["report"]["hooks"]}
    assert states[TARGETS[0]] == ("unresolvable", "psutil")
    assert states[TARGETS[1]] == ("unresolvable", "psutil")
    assert states[TARGETS[2]] == ("unresolvable", "msgspec")
    details = [h["detail"] for h in result["report"]["hooks"]]
    assert details[0] == "cannot import sglang.srt.arg_groups.speculative_hook: ModuleNotFoundError: No module named 'psutil'"
    # Names in the modules that did import were checked at runtime against the manifest.
    checked = {n["label"]: n["ok"] for n in result["report"]["names"]}
    assert checked["sglang.srt.plugins.hook_registry.HookRegistry.register"] is True
    assert checked["sglang.srt.plugins.load_plugins"] is True
    assert all(checked.values())


@pytest.mark.slow
def test_strict_mode_stops_loudly_naming_every_target():
    done = run_python(BYPASS_SGLANG_INIT + "from sglang.srt.plugins import load_plugins\nload_plugins()\n",
                      env={"DDTREE_ENABLE": "1"})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ddtree.sglang.errors.HookSelfCheckError: DDTree self-check failed: H1 ")
    for target in TARGETS:
        assert target in last
    assert "DDTREE_STRICT=1: stopping instead of serving linear DFlash" in last


def test_disabled_plugin_registers_nothing():
    result = _load({})
    assert result == {"error": None, "hooks": {}, "wrapped": False, "report": None}


def test_a_bad_variable_is_not_swallowed_by_load_plugins():
    result = _load({"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "many"})
    assert result["error"] == "PluginConfigError: DDTREE_BUDGET: expected an integer, got 'many'"
    assert result["hooks"] == {}


@pytest.mark.slow
def test_probe_reports_static_only_on_a_cpu_host():
    done = run_python("from ddtree.sglang.probe import main; raise SystemExit(main())")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["verdict"] == "static-only"
    assert result["gate"]["ok"] is True and result["gate"]["version"] == "0.5.23" and result["gate_from"] == "probe"
    assert result["entry_point"] == {"found": True, "value": "ddtree.sglang.plugin:register",
                                     "dist": "ddtree-ops", "count": 1}
    assert result["reasons"] == ["SGLang's speculative modules cannot import here (missing: msgspec, psutil); static checks only"]


PROBE_WITH_REPORT = """
import io, json, sys
from ddtree.sglang.probe import main
sys.stdin = io.StringIO(sys.argv[1])
raise SystemExit(main(["--gate-report", "-"]))
"""


@pytest.mark.slow
def test_probe_takes_the_callers_gate_report_and_judges_by_it():
    """Deploy's installer hands the probe the report it just made: the probe judges by that
    report (a structure finding in it fails the verdict) and says where the gate came from."""
    finding = {"kind": "name-mismatch", "file": "/site/sglang/srt/speculative/spec_info.py", "evidence": "structure",
               "detail": "SpeculativeAlgorithm.create_worker: signature changed"}
    report = {"ok": False, "structure_ok": False, "version": "0.5.23", "findings": [finding]}
    done = run_python(PROBE_WITH_REPORT.replace("sys.argv[1]", repr(json.dumps(report))))
    assert done.returncode == 1, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["gate_from"], result["gate"], result["verdict"]) == ("caller", report, "failed")
    assert result["reasons"][0] == "gate: /site/sglang/srt/speculative/spec_info.py: name-mismatch: " \
                                   "SpeculativeAlgorithm.create_worker: signature changed"

    done = run_python(PROBE_WITH_REPORT.replace("sys.argv[1]", repr('["not a report"]')))
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "--gate-report: stdin holds no gate report (a JSON object with structure_ok)")


PROBE_IMPORTS = """
import json, sys
from ddtree.sglang.probe import probe
result = probe(gate_report=json.loads(GATE), require_gate_ok=REQUIRE_OK)
print(json.dumps({"result": result, "imported": sorted(m for m in sys.modules if m.startswith("sglang.srt"))}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("gate, require_ok, why", [
    ({"ok": False, "structure_ok": False, "findings": []}, False, "the gate found SGLang's structure changed"),
    ({"ok": False, "structure_ok": True, "verdict": "structure ok, hashes drifted, not qualified", "findings": []},
     True, "the gate did not accept SGLang's files (structure ok, hashes drifted, not qualified)"),
])
def test_the_probe_imports_nothing_of_sglang_the_gate_did_not_accept(gate, require_ok, why):
    """Importing runs a file's code: files that failed the gate are never imported, not even to
    report on them (issue 40: a tampered spec_info.py ran as root in deploy's probe)."""
    done = run_python(PROBE_IMPORTS.replace("GATE", repr(json.dumps(gate))).replace("REQUIRE_OK", repr(require_ok)))
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imported"] == [] and seen["result"]["verdict"] == "failed"
    assert seen["result"]["reasons"][-1].startswith(why)


@pytest.mark.slow
def test_probe_fails_when_sglang_plugins_excludes_us():
    done = run_python("from ddtree.sglang.probe import main; raise SystemExit(main())",
                      env={"SGLANG_PLUGINS": "someone_else"})
    assert done.returncode == 1
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["verdict"] == "failed"
    assert "the plugin's self-check did not run (register() was not called by load_plugins)" in result["reasons"]
    assert result["reasons"][0].startswith("SGLANG_PLUGINS='someone_else' does not list ddtree: SGLang skips")


@pytest.mark.slow
def test_probe_accepts_an_sglang_plugins_list_that_names_us():
    """SGLang's real loader honours the list (srt/plugins/__init__.py:51-70): naming ddtree among
    others loads it as if the variable were unset."""
    done = run_python("from ddtree.sglang.probe import main; raise SystemExit(main())",
                      env={"SGLANG_PLUGINS": " someone_else , ddtree"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["verdict"] == "static-only"


APPLY_ON_A_RESOLVABLE_TARGET = BYPASS_SGLANG_INIT + """
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from ddtree.sglang import hooks
from ddtree.sglang.selfcheck import hook_status
from ddtree.sglang.targets import HookId, HookKind, HookSpec
spec = HookSpec(HookId.H3_VERIFY_MASK_POLICY, "policy_target.resolve", HookKind.AROUND, "around_verify_mask_policy", "")
other = HookSpec(HookId.H1_HANDLE_DFLASH, "policy_target.other", HookKind.AFTER, "after_handle_dflash", "")
states = [hook_status(other).state.value]
HookRegistry.register(spec.target, hooks.around_verify_mask_policy, HookType.AROUND)
states.append(hook_status(spec).state.value)  # registered, not applied yet
HookRegistry.apply_hooks()
states.append(hook_status(spec).state.value)
import policy_target
states.append(policy_target.resolve.__wrapped__.__name__)
print(json.dumps(states))
"""


def test_self_check_sees_a_hook_sglang_really_applied(tmp_path):
    (tmp_path / "policy_target.py").write_text(
        "def resolve(attn_backend):\n    return type(attn_backend).__name__, False\n"
        "def other(server_args):\n    return None\n"
    )
    done = run_python(APPLY_ON_A_RESOLVABLE_TARGET, extra_path=[tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["not-registered", "not-applied", "applied", "resolve"]


@pytest.mark.slow
def test_a_bad_variable_with_the_plugin_off_leaves_the_server_alone():
    for env in ({"DDTREE_ENABLE": "0", "DDTREE_BUDGET": "2000"}, {"DDTREE_BUDGTE": "64"}):
        result = _load(env)
        assert result == {"error": None, "hooks": {}, "wrapped": False, "report": None}, env
    # an unreadable DDTREE_ENABLE says nothing about intent: it stops the server
    result = _load({"DDTREE_ENABLE": "maybe"})
    assert result["error"] == "PluginConfigError: DDTREE_ENABLE: expected one of 1/0/true/false/yes/no/on/off, got 'maybe'"


# register() failing for a reason of its own: one of its modules cannot import (as a broken
# install or a missing dependency would make it). SGLang's load_plugins() catches and only
# logs what a plugin raises (sglang/srt/plugins/__init__.py:131-137 in 0.5.23).
BROKEN_TARGETS = "import sys\nsys.modules['ddtree.sglang.targets'] = None\n"
LOAD_ONLY = BYPASS_SGLANG_INIT + BROKEN_TARGETS + """
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print("SERVING", sorted(HookRegistry._hooks))
"""


@pytest.mark.slow
def test_any_failure_of_register_stops_a_strict_server_with_one_line():
    """#49 item 7: in strict mode (the default) a register() that fails stops the process at
    SGLang's own load_plugins(), naming the failure; the server never serves plain DFlash."""
    done = run_python(LOAD_ONLY, env={"DDTREE_ENABLE": "1", "DDTREE_STRICT": "1"})
    assert done.returncode != 0 and "SERVING" not in done.stdout, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ddtree.sglang.errors.PluginRegisterError: DDTree plugin: register() failed: "
                           "ModuleNotFoundError: import of ddtree.sglang.targets halted"), last
    assert last.endswith("(DDTREE_STRICT=1: stopping instead of serving plain DFlash; DDTREE_STRICT=0 serves "
                         "without DDTree)")


@pytest.mark.slow
def test_a_failed_register_with_strict_off_serves_without_ddtree_and_says_so():
    done = run_python(LOAD_ONLY, env={"DDTREE_ENABLE": "1", "DDTREE_STRICT": "0"})
    assert done.returncode == 0 and "SERVING []" in done.stdout, done.stderr[-2000:]
    assert "DDTree plugin: register() failed: ModuleNotFoundError" in done.stderr
    assert "(DDTREE_STRICT=0: serving without DDTree)" in done.stderr
    done = run_python(LOAD_ONLY, env={})  # not enabled: nothing to stop, nothing said loudly
    assert done.returncode == 0 and "SERVING []" in done.stdout, done.stderr[-2000:]


# register() failing half-way through its hooks: SGLang's registry refuses the second one.
SECOND_HOOK_REFUSED = BYPASS_SGLANG_INIT + """
from sglang.srt.plugins.hook_registry import HookRegistry
real, calls = HookRegistry.register.__func__, []
def register_twice_at_most(cls, *args, **kwargs):
    calls.append(args[0])
    if len(calls) == 2:
        raise RuntimeError("registry full")
    return real(cls, *args, **kwargs)
HookRegistry.register = classmethod(register_twice_at_most)
from sglang.srt.plugins import load_plugins
load_plugins()
print("SERVING", sorted(HookRegistry._hooks), len(calls))
"""


@pytest.mark.slow
def test_a_register_that_failed_half_way_leaves_no_hook_of_ours_when_not_strict():
    """DDTREE_STRICT=0 goes on without DDTree: with none of its hooks (H1 alone would resize
    the verify for a worker that is not ours), not with the ones registered before the failure."""
    done = run_python(SECOND_HOOK_REFUSED, env={"DDTREE_ENABLE": "1", "DDTREE_STRICT": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "SERVING [] 2"
    assert "register() failed: RuntimeError: registry full (DDTREE_STRICT=0: serving without DDTree)" in done.stderr
    done = run_python(SECOND_HOOK_REFUSED, env={"DDTREE_ENABLE": "1"})  # strict, the default
    assert done.returncode != 0 and "SERVING" not in done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith(
        "ddtree.sglang.errors.PluginRegisterError: DDTree plugin: register() failed: RuntimeError: registry full")


@pytest.mark.slow
def test_the_probe_imports_nothing_of_an_sglang_other_than_the_one_the_gate_checked(tmp_path):
    """A gate report about one SGLang folder, a probe whose interpreter would import SGLang from
    another: nothing is imported (the gate's hashes are about other files)."""
    import subprocess
    import sys

    from ddtree.sglang.gate import run_gate
    from sglang_plugin.dist import sglang_site

    report = run_gate(sglang_site() / "sglang").to_dict()
    report["package_dir"] = str(tmp_path / "elsewhere" / "sglang")
    done = subprocess.run(
        [sys.executable, "-m", "ddtree.sglang.probe", "--gate-report", "-", "--require-gate-ok"],
        input=json.dumps(report), capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(sglang_site())})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and result["verdict"] == "failed" and result["self_check"] is None, result
    assert result["reasons"][-1] == (f"the gate checked sglang at {report['package_dir']}, but this interpreter "
                                     f"imports it from {sglang_site() / 'sglang'}: its files were not imported")
