"""Stage `plugin`: the DDTree SGLang plugin in this host's Python environment.

Skips where SGLang is not installed. Fails when the static structure check refuses this
SGLang (a hooked name, signature or worker fact differs); drifted file hashes alone are
reported (metrics: evidence, drifted files, the installed hashes: what `ddtree-ops sglang
qualify` records), since whether they may deploy is the operator's qualification. Where
the plugin is deployed (`ddtree-ops deploy`), runs SGLang's own load_plugins() in a fresh
interpreter (ddtree.sglang.probe): the entry point must be discoverable and every hook must
apply where SGLang's speculative modules import; where they cannot import (no GPU stack),
the static checks stand in and the reason says so. On a host without a GPU whose environment
is a CPU test server (ddtree.sglang.cpu) the probe runs with SGLang's CPU engine, so every
hook applies for real there too. Skips when the plugin is not deployed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ddtree_ops.hostside.protocol import StageContext, StageResult

NAME = "plugin"
DESCRIPTION = "DDTree SGLang plugin: gate, entry point, hooks applied by SGLang's load_plugins()"
PROBE_TIMEOUT_S = 300


def _deployed_release() -> str | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="sglang.srt.plugins"):
        if ep.name == "ddtree" and ep.dist is not None:
            version = ep.dist.version or ""
            return version.split("+", 1)[1] if "+" in version else version
    return None


def cpu_test_server_env() -> bool:
    from ddtree.sglang.cpu.environment import prepared

    return prepared()


def run(ctx: StageContext) -> StageResult:
    from ddtree.sglang.config import ENV_SGLANG_PLUGINS, plugins_filter_problem
    from ddtree.sglang.gate import Evidence, find_package_dir, run_gate

    package_dir = find_package_dir()
    if package_dir is None:
        return StageResult.skipped(f"sglang is not installed in {sys.executable}")
    gate = run_gate(package_dir)
    metrics = {"sglang": gate.version, "sglang_dir": str(package_dir), "gate_ok": gate.ok,
               "structure_ok": gate.structure_ok, "pinned": gate.pinned, "evidence": gate.verdict(),
               "broken_hooks": gate.broken_hooks, "drifted_files": gate.drifted_files,
               "file_sha256": gate.file_sha256, "gate_findings": [f.line() for f in gate.findings]}
    for finding in gate.findings:
        ctx.log(finding.line())
    if not gate.structure_ok:
        return StageResult.failed(f"sglang {gate.version}: structure differs in {', '.join(gate.broken_hooks)}: "
                                  f"{gate.of(Evidence.STRUCTURE)[0].line()}", metrics=metrics)
    deployed = _deployed_release()
    metrics["deployed_release"] = deployed
    filtered_out = plugins_filter_problem(os.environ.get(ENV_SGLANG_PLUGINS))
    metrics["plugins_problem"] = filtered_out
    if deployed is None:
        return StageResult.skipped(f"sglang {gate.version}: {gate.verdict()}; the plugin is not deployed in "
                                   f"{sys.executable} (run `ddtree-ops deploy`)"
                                   + (f"; also: {filtered_out}" if filtered_out else ""), metrics=metrics)
    # A fresh interpreter without the release on its path: what SGLang's processes see.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DDTREE_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if ctx.device != "cuda" and cpu_test_server_env():  # SGLang's CPU engine: its speculative modules import
        from ddtree.sglang.cpu.environment import SERVER_ENV

        env.update(SERVER_ENV)
    done = subprocess.run([sys.executable, "-m", "ddtree.sglang.probe"], capture_output=True, text=True,
                          env=env, cwd="/", timeout=PROBE_TIMEOUT_S)
    try:
        probe = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return StageResult.failed(f"the probe did not report: {done.stderr.strip()[-400:]}", metrics=metrics)
    metrics.update(verdict=probe["verdict"], reasons=probe["reasons"],
                   hooks={h["hook_id"]: h["state"] for h in (probe.get("self_check") or {}).get("hooks", [])})
    note = "" if ctx.expected_release in (None, deployed) else \
        f" (deployed release {deployed} differs from the pushed {ctx.expected_release})"
    if probe["verdict"] == "failed":
        return StageResult.failed("; ".join(probe["reasons"]) + note, metrics=metrics)
    evidence = f" ({gate.verdict()})"
    if probe["verdict"] == "static-only":
        return StageResult.passed(probe["reasons"][0] + evidence + note, metrics=metrics)
    return StageResult.passed(f"hooks applied by SGLang's load_plugins() (sglang {gate.version}){evidence}{note}",
                              metrics=metrics)
