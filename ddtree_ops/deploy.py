"""Deploy the SGLang plugin into a host's Python environment, and roll it back.

Per host, under the host lock (WORKDIR/lock, shared with `push`), in ONE process of the
inventory's `python:` (the agent's `deploy` / `rollback` operations, which run the installer
in-process):
deploy   - make the bundle the active release (the archive is sent only if the host lacks an
           intact copy), then run the host-side installer (ddtree_ops/hostside/sglang_install.py,
           from the same bundle): gate, install (.pth + minimal dist-info), verify, record what was
           added under WORKDIR/deployments/. The verification is the one other Python start:
           it must be a fresh interpreter, which loads the plugin as SGLang would;
rollback - remove exactly what the record lists, only inside what deploy adds, and only if
           nothing there changed since deploy (`--force`: changed files go too); after an
           upgrade, put the replaced release back byte for byte (its record kept it).
`--dry-run` sends nothing and takes no lock: the installer only reports its plan.
The gate's modules travel on stdin and are loaded in memory on the host, so a dry run writes
nothing there. Refusals (gate findings, conflicts) are RemoteStepError: exit 5. The gate's two levels of
evidence (structure, pins) are decided on the host; the operator's qualification file
travels with the gate, so a qualified version whose hashes drifted deploys.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from ddtree_ops.errors import RemoteStepError
from ddtree_ops.inventory import Host
from ddtree_ops.release import HOSTSIDE_DIR, ReleaseBundle
from ddtree_ops.ids import IdKind, check_optional_host_id
from ddtree_ops.qualification import QualificationFile
from ddtree_ops.remote_layout import (
    AGENT_REPLY_MAX_BYTES,
    DEFAULT_KEEP,
    agent_argv,
    agent_preamble,
    parse_agent_reply,
    push_outcome,
    lock_wait_within,
    run_with_release_on_demand,
)
from ddtree_ops.transport.base import Transport

INSTALLER = f"{HOSTSIDE_DIR}/sglang_install.py"
# Where a checkout from before the host side was one package keeps it: deploying such a
# checkout (going back to an older release) runs its own installer.
OLDER_INSTALLER = "src/ddtree/sglang/install.py"
# The gate and its modules, served in memory on the host (a bare `ddtree` package: the core
# is not needed); its data (the shipped manifests, the sources the structural facts read:
# the worker's and tree_round's, the operator's qualification entries) travels next to them.
GATE_PACKAGES = ("ddtree", "ddtree.sglang", "ddtree.sglang.manifests")
GATE_MODULES = ("ddtree.bounded_files", "ddtree.sglang.errors", "ddtree.sglang.manifest",
                "ddtree.sglang.qualification", "ddtree.sglang.structure", "ddtree.sglang.gate")
WORKER = "src/ddtree/sglang/worker.py"
TREE_ROUND = "src/ddtree/sglang/tree_round.py"
MANIFESTS_DIR = "src/ddtree/sglang/manifests/"


class InstallMode(Enum):
    """What the installer accepts (its MODE argument)."""

    GATED = "0"  # structure holds, hashes pinned or qualified
    FORCE = "1"  # anything, recorded (--force)
    QUALIFY = "qualify"  # structure holds, drifted hashes allowed, recorded (sglang qualify)


def _bundle_text(bundle: ReleaseBundle, relpath: str) -> str:
    for entry in bundle.files:
        if entry.relpath == relpath:
            return entry.source.read_text(encoding="utf-8")
    raise RemoteStepError(f"release {bundle.release_id} has no {relpath} (source {bundle.source_root})")


def gate_payload(bundle: ReleaseBundle, qualified: Optional[QualificationFile] = None) -> dict[str, Any]:
    modules: dict[str, str] = {"ddtree": ""}
    for package in GATE_PACKAGES[1:]:
        modules[package] = _bundle_text(bundle, "src/" + package.replace(".", "/") + "/__init__.py")
    for module in GATE_MODULES:
        modules[module] = _bundle_text(bundle, "src/" + module.replace(".", "/") + ".py")
    manifests = {entry.relpath[len(MANIFESTS_DIR):]: entry.source.read_text(encoding="utf-8")
                 for entry in bundle.files
                 if entry.relpath.startswith(MANIFESTS_DIR) and entry.relpath.endswith(".json")}
    return {"modules": modules, "packages": list(GATE_PACKAGES), "manifests": manifests,
            "worker": _bundle_text(bundle, WORKER), "tree_round": _bundle_text(bundle, TREE_ROUND),
            "qualified": [e.to_dict() for e in qualified.entries] if qualified else [],
            "qualified_source": str(qualified.path) if qualified else "qualification file"}


def call_installer(
    transport: Transport, host: Host, bundle: ReleaseBundle, op: str, *args: str,
    timeout: Optional[float] = None, qualified: Optional[QualificationFile] = None,
    server_defaults: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    stdin = installer_stdin(bundle, op, qualified, server_defaults)
    # With site-packages: the installer works on the environment's site dir.
    result = transport.run(agent_argv(host, op, *args, site=True), stdin=stdin, timeout=timeout,
                           max_output_bytes=AGENT_REPLY_MAX_BYTES)
    return parse_agent_reply(host, op, result)


@dataclass(frozen=True)
class DeployOutcome:
    release: str
    # installed | replaced | repaired | unchanged; a dry run: would install | would replace <release> |
    # would repair | would stay unchanged, each after "would recover, then " if a deploy died half-way
    action: str
    python: str
    sglang: str  # "<version> at <dir>"
    verdict: str  # the probe's verdict ("-" for a dry run)
    forced: bool
    evidence: str = ""  # the gate's verdict: "structure ok, pinned" / "... qualified (run R)" / ...
    qualifying: bool = False
    qualified_by: Optional[dict[str, Any]] = None
    gate: Optional[dict[str, Any]] = None
    adds: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    record: Optional[str] = None
    recovered: Optional[dict[str, Any]] = None
    gate_findings: tuple[str, ...] = field(default=())
    server_defaults: Optional[dict[str, Any]] = None  # what `--budget` wrote into the payload
    rollback_restores: Optional[str] = None  # the release `rollback` puts back (None: it removes the plugin)

    def to_dict(self) -> dict[str, Any]:
        return {
            "release": self.release, "action": self.action, "python": self.python, "sglang": self.sglang,
            "verdict": self.verdict, "forced": self.forced, "evidence": self.evidence,
            "qualifying": self.qualifying, "qualified_by": self.qualified_by, "adds": list(self.adds),
            "reasons": list(self.reasons), "record": self.record, "recovered": self.recovered,
            "gate_findings": list(self.gate_findings), "server_defaults": self.server_defaults,
            "rollback_restores": self.rollback_restores,
        }


def _findings(gate: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{f['file']}: {f['kind']}: {f['detail']}" for f in gate.get("findings", []))


def deploy_host(
    transport: Transport, host: Host, bundle: ReleaseBundle, *, force: bool = False, dry_run: bool = False,
    allow_shared_env: bool = False, qualified: Optional[QualificationFile] = None,
    mode: Optional[InstallMode] = None, server_defaults: Optional[dict[str, Any]] = None,
) -> DeployOutcome:
    """`allow_shared_env`: deploy into a site-packages that other accounts can write (refused otherwise);
    `qualified`: the operator's qualification file; `mode`: what the installer accepts (default: gated, or forced);
    `server_defaults`: {"variables", "provenance"} for the payload's defaults file (`--budget`)."""
    flag = (mode or (InstallMode.FORCE if force else InstallMode.GATED)).value
    shared = "1" if allow_shared_env else "0"
    if dry_run:
        plan = call_installer(transport, host, bundle, "plan", bundle.release_id, flag, shared,
                              qualified=qualified, server_defaults=server_defaults)["plan"]
        if plan["refusals"]:
            raise RemoteStepError(f"{host.name}: deploy would be refused: " + "; ".join(plan["refusals"]))
        check_defaults_applied(host, bundle, server_defaults, plan.get("server_defaults"))
        return _outcome(bundle, plan, action=_would(plan["action"]), verdict="-", reasons=(),
                        server_defaults=server_defaults)
    limit = host.command_timeout
    argv = agent_argv(host, "deploy", bundle.release_id, str(DEFAULT_KEEP), f"{lock_wait_within(limit):g}", flag,
                      shared, site=True)  # with site-packages: the installer works on the environment's site dir
    result, _ = run_with_release_on_demand(transport, argv, bundle,
                                           before=installer_stdin(bundle, "install", qualified, server_defaults),
                                           timeout=limit)
    both = parse_agent_reply(host, "deploy", result)
    push_outcome(host, bundle, both["push"], 0)  # checks the release ids the host named
    reply = both["install"]
    check_defaults_applied(host, bundle, server_defaults, reply.get("server_defaults"))
    probe = reply.get("probe") or {}
    return _outcome(
        bundle, reply["plan"], action=reply["action"], verdict=probe.get("verdict", "?"),
        reasons=tuple(probe.get("reasons") or ()), record=reply.get("record"), recovered=reply.get("recovered"),
        server_defaults=server_defaults,
        rollback_restores=check_optional_host_id(host.name, IdKind.RELEASE, reply.get("rollback_restores"),
                                                 "deploy: rollback_restores"),
    )


def check_defaults_applied(host: Host, bundle: ReleaseBundle, sent: Optional[dict[str, Any]],
                           echoed: Any) -> None:
    """An installer that predates server defaults ignores them: `--budget` must not vanish silently."""
    if sent is not None and echoed != sent:
        raise RemoteStepError(f"{host.name}: the installer of release {bundle.release_id} did not apply the server "
                              f"defaults (--budget): it predates them, and deployed the plugin without them; deploy "
                              f"a newer release, or drop --budget")


def _would(action: str) -> str:
    """The plan's action as a prediction: "recover, then unchanged" -> "would recover, then stay unchanged"."""
    if action.endswith("unchanged"):
        action = action[: -len("unchanged")] + "stay unchanged"
    return f"would {action}"


def _outcome(bundle: ReleaseBundle, plan: dict[str, Any], **fields: Any) -> DeployOutcome:
    env, gate = plan["environment"], plan["gate"]
    return DeployOutcome(
        release=bundle.release_id, python=env["python"], sglang=f"{gate.get('version')} at {env['sglang_dir']}",
        forced=bool(plan["forced"]), evidence=gate.get("verdict", ""), qualifying=bool(plan.get("qualifying")),
        qualified_by=gate.get("qualified_by"), gate=gate, adds=tuple(plan["adds"]), gate_findings=_findings(gate),
        **fields,
    )


@dataclass(frozen=True)
class RollbackOutcome:
    """One rollback undoes exactly one step: the last deploy (rolled-back), a deploy killed
    before its record (recovered: the environment as that deploy found it), or the rest of a
    rollback killed half-way (rolled-back, interrupted). `step` says which, in words."""

    action: str  # rolled-back | nothing-deployed | recovered
    release: Optional[str]  # the deployment undone
    removed: tuple[str, ...]
    modified_since_deploy: tuple[str, ...]
    recovered: Optional[dict[str, Any]]
    restored: Optional[str] = None  # the release put back (the one `release` had replaced), else None
    interrupted: bool = False  # the step undone or finished was one a kill had left half-done
    release_defaults: Optional[dict[str, str]] = None  # the undone deployment's server defaults (--budget)
    restored_defaults: Optional[dict[str, str]] = None  # the restored one's

    @property
    def step(self) -> str:
        undone = f"release {self.release}{_defaults_note(self.release_defaults)}" if self.release else "the deployment"
        back = (f"release {self.restored}{_defaults_note(self.restored_defaults)} is deployed again"
                if self.restored else "the plugin is removed")
        if self.action == "recovered" and self.release:
            return f"undid the interrupted deploy of {undone}: {back}, as before that deploy"
        if self.action == "rolled-back" and self.interrupted:
            return f"finished the interrupted rollback of {undone}: {back}"
        if self.action == "rolled-back":
            return f"rolled back {undone}: {back}"
        if self.action == "recovered":
            return "removed what a killed deploy left; nothing is deployed"
        return "nothing deployed: nothing to roll back"

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "step": self.step, "release": self.release, "restored": self.restored,
                "interrupted": self.interrupted, "release_defaults": self.release_defaults,
                "restored_defaults": self.restored_defaults,
                "removed": list(self.removed), "modified_since_deploy": list(self.modified_since_deploy),
                "recovered": self.recovered}


def _defaults_note(variables: Optional[dict[str, str]]) -> str:
    """' (DDTREE_BUDGET=16)' for a deployment made with server defaults, '' without."""
    return f" ({', '.join(f'{k}={v}' for k, v in sorted(variables.items()))})" if variables else ""


def _host_defaults(host: Host, value: Any, field_name: str) -> Optional[dict[str, str]]:
    """Server-default variables a host's reply names: DDTREE_* -> a short value; anything else
    is a protocol error (the host's words reach the operator's screen)."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 8 or not all(
            isinstance(k, str) and isinstance(v, str) and _DEFAULT_NAME.fullmatch(k) and _DEFAULT_VALUE.fullmatch(v)
            for k, v in value.items()):
        raise RemoteStepError(f"{host.name}: rollback: {field_name}: expected DDTREE_* variables, "
                              f"got {str(value)[:80]!r}")
    return dict(value)


ROLLBACK_ACTIONS = ("rolled-back", "nothing-deployed", "recovered")
_DEFAULT_NAME = re.compile(r"DDTREE_[A-Z_]{1,32}")
_DEFAULT_VALUE = re.compile(r"[A-Za-z0-9._-]{0,32}")


def rollback_host(transport: Transport, host: Host, bundle: ReleaseBundle, *, force: bool = False) -> RollbackOutcome:
    """`force`: also remove files changed by hand since deploy (else the rollback is refused, naming them)."""
    argv = agent_argv(host, "rollback", f"{lock_wait_within(host.command_timeout):g}", "1" if force else "0", site=True)
    stdin = agent_preamble() + installer_stdin(bundle, "rollback")
    reply = parse_agent_reply(host, "rollback", transport.run(argv, stdin=stdin, timeout=host.command_timeout,
                                                              max_output_bytes=AGENT_REPLY_MAX_BYTES))
    reply = reply["rollback"]
    removed = reply.get("removed") or {}
    action = reply.get("action")
    if action not in ROLLBACK_ACTIONS:
        raise RemoteStepError(f"{host.name}: rollback: unknown action {str(action)[:40]!r}")
    return RollbackOutcome(
        action=action,
        release=check_optional_host_id(host.name, IdKind.RELEASE, reply.get("release"), "rollback: release"),
        removed=tuple(removed.get("removed", ())), modified_since_deploy=tuple(removed.get("modified_since_deploy", ())),
        recovered=reply.get("recovered"),
        restored=check_optional_host_id(host.name, IdKind.RELEASE, reply.get("restored"), "rollback: restored"),
        interrupted=reply.get("interrupted") is True,
        release_defaults=_host_defaults(host, reply.get("release_defaults"), "release_defaults"),
        restored_defaults=_host_defaults(host, reply.get("restored_defaults"), "restored_defaults"),
    )


def installer_stdin(bundle: ReleaseBundle, op: str, qualified: Optional[QualificationFile] = None,
                    server_defaults: Optional[dict[str, Any]] = None) -> bytes:
    """What the installer reads on stdin: its own source (length-prefixed for BOOTSTRAP),
    then, except for rollback, the gate's modules and data (and any server defaults) as one JSON line."""
    relpaths = {entry.relpath for entry in bundle.files}
    installer = INSTALLER if INSTALLER in relpaths or OLDER_INSTALLER not in relpaths else OLDER_INSTALLER
    source = _bundle_text(bundle, installer).encode("utf-8")
    stdin = b"%d\n" % len(source) + source
    if op != "rollback":
        line = gate_payload(bundle, qualified)
        if server_defaults is not None:
            line["server_defaults"] = server_defaults
        stdin += json.dumps(line).encode("utf-8") + b"\n"
    return stdin
