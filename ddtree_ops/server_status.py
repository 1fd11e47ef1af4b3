"""`ddtree-ops status`, per host: what serves there, and whether DDTree still accepts what it
accepted when the host was qualified.

One process of the host's Python (the agent's `server-status`, over the SSH connection every
verb uses) reports the SGLang installed, what `deploy` recorded in that environment, and the
serving SGLang's `/metrics`, fetched on the host's own loopback at the inventory's
`sglang_port` (no port is opened to the operator). The operator side parses the metrics
(ddtree_ops.live_metrics) and holds the live acceptance against the host's newest passing
`sglang-e2e` at the same budget in the local run store (a `sglang qualify` run counts, and is
named as one): below it by more than the tolerance, the host fails (exit 5).

The live figure is the plugin's acceptance length since the server started (accepted tree
indices per request-round, root included); the stage's is SGLang's per-request
completion_tokens / spec_verify_ct, which also counts the prefill's token: on the same
traffic it reads about 1/rounds higher, far inside the default tolerance.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ddtree_ops.errors import RemoteStepError
from ddtree_ops.inventory import Host
from ddtree_ops.live_metrics import METRIC_PREFIXES, LiveReading, parse_metrics
from ddtree_ops.transport.base import Transport

INSTALLER = Path(__file__).parent / "hostside" / "sglang_install.py"
E2E_STAGE, E2E_TABLE = "sglang-e2e", "sglang_e2e"
METRICS_TIMEOUT_S = 10.0


class Verdict:
    OK = "ok"  # judged: within the tolerance of the reference
    BELOW = "below reference"  # judged: the host fails
    NOT_JUDGED = "not judged"  # no server, DDTree off, too little traffic or no reference (the note says)


@dataclass(frozen=True)
class Reference:
    """What the host accepted at this budget in a passing `sglang-e2e` (of a qualify run or a smoke run)."""

    run_id: str
    command: str  # the run's command: "qualify", "smoke", ...
    budget: int
    acceptance_length: float
    device: Optional[str]

    @property
    def described(self) -> str:
        kind = "qualification" if self.command == "qualify" else E2E_STAGE
        return f"{kind} run {self.run_id}"

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "described": self.described}


@dataclass
class HostStatus:
    sglang: Optional[str]  # version installed in the inventory's python (None: not installed)
    deployed: dict[str, Any]  # the deploy record's summary ({"record": None}: nothing deployed)
    server: dict[str, Any]  # {"state", "port", "error"?}: running | not-running | no-metrics | error
    live: Optional[LiveReading] = None
    reference: Optional[Reference] = None
    verdict: str = Verdict.NOT_JUDGED
    note: str = ""
    # {"enabled", "budget", "from"}: "the server" (live), "deploy --budget" or "the plugin's defaults" (no server)
    ddtree: dict[str, Any] = field(default_factory=lambda: {"enabled": None, "budget": None, "from": None})

    def to_dict(self) -> dict[str, Any]:
        return {"sglang": self.sglang, "deployed": self.deployed, "server": self.server, "ddtree": self.ddtree,
                "live": self.live.to_dict() if self.live else None,
                "reference": self.reference.to_dict() if self.reference else None,
                "verdict": self.verdict, "note": self.note}


class AcceptanceDropped(RemoteStepError):
    """The server's live acceptance is below the host's reference by more than the tolerance."""

    def __init__(self, message: str, status: HostStatus):
        super().__init__(message)
        self.status = status
        self.details = status.to_dict()


def fetch(transport: Transport, host: Host, port: int) -> dict[str, Any]:
    """The agent's `server-status` reply: {"sglang", "deployed", "server"}."""
    from ddtree_ops.remote_layout import call_agent

    installer = INSTALLER.read_bytes()
    payload = b"%d\n" % len(installer) + installer + json.dumps({"metric_prefixes": list(METRIC_PREFIXES)}).encode() + b"\n"
    return call_agent(transport, host, "server-status", str(port), f"{METRICS_TIMEOUT_S:g}",
                      payload=io.BytesIO(payload), timeout=host.command_timeout)


def deployed_ddtree(deployed: dict[str, Any]) -> dict[str, Any]:
    """DDTree as the deploy left it for a server that sets no DDTREE_* itself: the payload's
    defaults (`deploy --budget`) over the plugin's own."""
    from ddtree.sglang.config import DDTreeConfig, config_from_variables
    from ddtree.sglang.errors import PluginConfigError

    variables = deployed.get("server_defaults") or {}
    try:
        config = config_from_variables(variables) if isinstance(variables, dict) else DDTreeConfig()
    except (PluginConfigError, AttributeError, TypeError):  # the host's file, read there: not ours to trust
        config = DDTreeConfig()
    return {"enabled": config.enabled, "budget": config.budget,
            "from": "deploy --budget" if variables else "the plugin's defaults"}


def host_status(host: Host, port: int, reply: dict[str, Any]) -> HostStatus:
    """The facts of one reply, before any judging (a reply of the wrong shape reads as nothing known)."""
    def part(name: str, empty: dict[str, Any]) -> dict[str, Any]:
        value = reply.get(name)
        return value if isinstance(value, dict) else empty

    sglang, deployed = part("sglang", {}), part("deployed", {"record": None})
    server = part("server", {"state": "error", "error": "no server facts in the host's reply"})
    version = sglang.get("version") if sglang.get("installed") else None
    status = HostStatus(sglang=version if isinstance(version, str) else None, deployed=deployed,
                        server={**{k: v for k, v in server.items() if k != "metrics"}, "port": port})
    if server.get("state") == "running":
        status.live = parse_metrics(host.name, str(server.get("metrics") or ""))
        status.ddtree = {"enabled": status.live.ddtree, "budget": status.live.budget, "from": "the server"}
    elif deployed.get("record"):
        status.ddtree = deployed_ddtree(deployed)
    return status


def find_reference(runs_root: Path, host: str, budget: int) -> Optional[Reference]:
    """The host's newest passing `sglang-e2e` with a DDTree row at `budget`, or None."""
    from ddtree_ops.errors import ConfigError
    from ddtree_ops.hostside.stages.sglang_e2e import plan_variants
    from ddtree_ops.results import RunStore, load_host, read_json

    wanted = plan_variants([budget])[-1].name  # the stage's own name for its DDTree row at this budget
    store = RunStore(runs_root)
    for run_id in reversed(store.list_runs()):
        folder = store.run_dir(run_id)
        if not (folder / host / "run.json").is_file():
            continue
        try:
            meta = read_json(folder / "run.json")
            record = load_host(folder / host, host, run_id, meta.get("stages") if isinstance(meta.get("stages"), list) else [])
        except ConfigError:
            continue  # a damaged run says nothing about this host
        stage = record.stages.get(E2E_STAGE)
        if stage is None or stage.status.value != "pass":
            continue
        for row in stage.tables.get(E2E_TABLE, []):
            value = row.get("acceptance_length")
            if row.get("variant") == wanted and isinstance(value, (int, float)) and not isinstance(value, bool):
                return Reference(run_id, str(meta.get("command") or "smoke"), budget, float(value), row.get("device"))
    return None


def judge(status: HostStatus, host: str, reference: Optional[Reference], tolerance: float,
          min_request_rounds: int) -> HostStatus:
    """Fill in the verdict (and why); AcceptanceDropped when the live figure is below the
    reference by more than `tolerance`."""
    status.reference = reference
    live, port = status.live, status.server.get("port")
    state = status.server.get("state")
    if state == "not-running":
        status.note = f"no server running on port {port}"
    elif state == "no-metrics":
        status.note = f"the server on port {port} serves no /metrics (start it with --enable-metrics)"
    elif state != "running":
        status.note = f"port {port}: {status.server.get('error') or state}"
    elif live is None or not live.ddtree:
        status.note = f"DDTree is off in the server on port {port} (no ddtree_ series in its /metrics)"
    elif live.budget is None:
        status.note = "the server reports more than one budget"
    elif reference is None:
        status.note = (f"no passing {E2E_STAGE} at budget {live.budget} for this host in the run store "
                       f"(ddtree-ops smoke -H {host} --stages {E2E_STAGE} --budgets {live.budget})")
    elif live.request_rounds < min_request_rounds:
        status.note = f"{live.request_rounds} request-rounds so far; judged from {min_request_rounds}"
    else:
        shortfall = reference.acceptance_length - (live.acceptance_length or 0.0)
        if shortfall > tolerance:
            status.verdict = Verdict.BELOW
            status.note = (f"live acceptance {live.acceptance_length:.3f} at budget {live.budget} is below "
                           f"{reference.acceptance_length:.3f} of {reference.described} by more than {tolerance:g}")
            raise AcceptanceDropped(f"{host}: {status.note}", status)
        status.verdict = Verdict.OK
        status.note = f"within {tolerance:g} of {reference.described}"
    return status
