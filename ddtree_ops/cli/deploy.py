"""`ddtree-ops deploy` / `ddtree-ops rollback`: the SGLang plugin in the hosts' Python environments."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ddtree_ops.cli.options import (
    DEFAULT_PARALLEL,
    AcceptNewHostKeysOpt,
    FailFastOpt,
    FanoutOptions,
    HostsOpt,
    InventoryOpt,
    JsonOpt,
    MaxFailOpt,
    ParallelOpt,
    SerialOpt,
    SourceOpt,
    rollout_policy,
    select_hosts,
)
from ddtree_ops.cli.report import RunsDirOpt
from ddtree_ops.deploy_budget import parse_budget_option
from ddtree_ops.errors import RemoteStepError

GateStagesOpt = Annotated[Optional[str], typer.Option(
    "--gate-stages", metavar="STAGES",
    help="Smoke stages that must pass on a batch before the next starts (default with --serial: plugin; "
         "e.g. plugin,sglang-e2e).", show_default=False)]
DEFAULT_GATE_STAGES = "plugin"
BudgetOpt = Annotated[Optional[str], typer.Option(
    "--budget", metavar="auto|N",
    help="Deploy with DDTree's default DDTREE_BUDGET set (and DDTree enabled): N, or auto: the host's latest "
         "recommendation at --for-concurrency (DFlash or no speculation recommended: deployed disabled). "
         "DDTREE_* set in the server's environment still win.", show_default=False)]
ForConcurrencyOpt = Annotated[Optional[int], typer.Option(
    "--for-concurrency", metavar="N", help="With --budget auto: the concurrent requests the host serves.",
    show_default=False)]


class GateFailed(RemoteStepError):
    """The deploy went through, but a gate stage did not pass on the host: the host changed."""

    def __init__(self, message: str, deployed: Any, gate: dict[str, Any]):
        super().__init__(message)
        self.deployed, self.gate = deployed, gate
        self.details = {**deployed.to_dict(), "gate": gate}


def run_gate(ctx: Any, bundle: Any, stages: list[str]) -> dict[str, Any]:
    """Run the gate stages with the smoke runner of the release just deployed, on the same
    connection: stage -> {"status", "reason"}. Any stage that did not pass (a skip included:
    it says nothing about health) raises later, in `gated_deploy`."""
    from ddtree_ops.smoke import DEFAULT_STAGE_TIMEOUT_S, SILENCE_LIMIT_S, SmokePlan, run_timeout, runner_argv
    from ddtree_ops.remote_layout import remote_workdir
    from ddtree_ops.results import new_run_id, parse_record

    plan = SmokePlan(run_id=new_run_id(), stages=stages, options={"seed": 0}, keep_going=True,
                     stage_timeout_s=DEFAULT_STAGE_TIMEOUT_S, release_id=bundle.release_id)
    ended: dict[str, Any] = {}

    def on_line(line: str) -> None:
        record = parse_record(line)
        if record is not None and record.get("event") == "stage_end" and record.get("stage") in stages:
            ended[record["stage"]] = {"status": record.get("status"), "reason": record.get("reason") or ""}

    workdir = remote_workdir(ctx.transport, ctx.host)
    ctx.report(f"gate: {','.join(stages)}")
    ctx.transport.run(runner_argv(ctx.host, workdir, plan), on_stdout_line=on_line,
                      timeout=run_timeout(plan, ctx.host), idle_timeout=SILENCE_LIMIT_S)
    return {stage: ended.get(stage, {"status": "not run", "reason": "the runner reported no result"})
            for stage in stages}


def gated_deploy(ctx: Any, bundle: Any, force: bool, gate_stages: list[str],
                 allow_shared_env: bool = False, qualified: Any = None,
                 server_defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Deploy, then (when asked) the gate: {"deployed": DeployOutcome, "gate": {...} or None}."""
    from ddtree_ops.deploy import deploy_host

    ctx.report("deploying")
    deployed = deploy_host(ctx.transport, ctx.host, bundle, force=force, allow_shared_env=allow_shared_env,
                           qualified=qualified, server_defaults=server_defaults)
    if not gate_stages:
        return {"deployed": deployed, "gate": None}
    gate = run_gate(ctx, bundle, gate_stages)
    failing = [(stage, r) for stage, r in gate.items() if r["status"] != "pass"]
    if failing:
        stage, r = failing[0]
        raise GateFailed(f"{ctx.host.name}: gate: {stage} {r['status']}" + (f": {r['reason']}" if r["reason"] else ""),
                         deployed, gate)
    return {"deployed": deployed, "gate": gate}


def _deployed(outcome: Any) -> Any:
    """The host's DeployOutcome: its result, or what a failed gate carries (None otherwise)."""
    if outcome.ok:
        return outcome.value["deployed"] if isinstance(outcome.value, dict) else outcome.value
    return getattr(outcome.error, "deployed", None)


def deploy_changed(outcome: Any) -> bool:
    """Whether this deploy changed the host's environment (a gate failure after it included)."""
    deployed = _deployed(outcome)
    return deployed is not None and not deployed.action.endswith("unchanged")


def rollback_command(inventory: Optional[Path], source: Optional[Path], hosts: list[str]) -> str:
    words = ["ddtree-ops", "rollback"]
    if inventory is not None:
        words += ["-i", str(inventory)]
    words += ["-H", ",".join(hosts)]
    if source is not None:
        words += ["--source", str(source)]
    return " ".join(shlex.quote(w) for w in words)


def _note(outcome: Any) -> str:
    """Reasons (probe), else gate findings, else for a plan the files it would add."""
    if outcome.reasons or outcome.gate_findings:
        return "; ".join(outcome.reasons or outcome.gate_findings)[:200]
    if outcome.action.startswith("would"):
        return "adds " + ", ".join(Path(p).name for p in outcome.adds)
    return ""


def deploy(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing on any host.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Deploy despite gate findings (changed structure, unqualified hashes); recorded.")
    ] = False,
    allow_shared_env: Annotated[
        bool, typer.Option("--allow-shared-env", help="Deploy into a site-packages other accounts can write"
                                                      " (refused otherwise: they could replace what deploy writes).")
    ] = False,
    qualified: Annotated[Optional[Path], typer.Option(
        "--qualified", help="Qualification file (default: sglang-qualified.json next to the inventory).",
        show_default=False)] = None,
    source: SourceOpt = None,
    json_out: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    fail_fast: FailFastOpt = False,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
    serial: SerialOpt = None,
    max_fail_percent: MaxFailOpt = None,
    gate_stages: GateStagesOpt = None,
    budget: BudgetOpt = None,
    for_concurrency: ForConcurrencyOpt = None,
    runs_dir: RunsDirOpt = None,
) -> int:
    """Install the DDTree SGLang plugin (entry point sglang.srt.plugins:ddtree) into each host's `python:`
    environment: gate, install, verify in a fresh interpreter, record what was added."""
    from ddtree_ops.cli.console import run_on_hosts, say
    from ddtree_ops.cli.smoke import parse_stages
    from ddtree_ops.deploy import deploy_host
    from ddtree_ops.qualification import load_file
    from ddtree_ops.release import build_bundle

    policy = rollout_policy(serial, max_fail_percent, default_budget=0.0)
    stages = parse_stages(gate_stages if gate_stages is not None else
                          (DEFAULT_GATE_STAGES if policy.batched and not dry_run else None))
    budget_choice = parse_budget_option(budget, for_concurrency)
    loaded, selected = select_hosts(inventory, hosts)
    qualification = load_file(qualified, loaded.source)
    defaults = server_defaults_by_host([h.name for h in selected], budget_choice, for_concurrency, runs_dir)
    bundle = build_bundle(source)
    if stages:
        from ddtree_ops.smoke import check_stages_in_bundle

        check_stages_in_bundle(stages, {f.relpath for f in bundle.files})
    if not json_out:
        say(f"{'plan for ' if dry_run else ''}release {bundle.release_id}{' (--force)' if force else ''}"
            + (f", each batch gated by {','.join(stages)}" if stages and not dry_run else ""))
        for name, chosen in defaults.items():
            say(f"{name}: {chosen.note}")

    def task(ctx: Any) -> Any:
        if dry_run:
            ctx.report("planning")
            return deploy_host(ctx.transport, ctx.host, bundle, force=force, dry_run=True,
                               allow_shared_env=allow_shared_env, qualified=qualification,
                               server_defaults=payload_for(ctx.host.name))
        return gated_deploy(ctx, bundle, force, stages, allow_shared_env, qualification, payload_for(ctx.host.name))

    def payload_for(name: str) -> Optional[dict[str, Any]]:
        return defaults[name].to_payload() if name in defaults else None

    def to_json(value: Any) -> Any:
        if isinstance(value, dict):
            return {**value["deployed"].to_dict(), "gate": value["gate"]}
        return value.to_dict()

    def row(o: Any) -> list[str]:
        d = _deployed(o) if not dry_run else o.value
        gate = (o.value["gate"] if o.ok and isinstance(o.value, dict) else getattr(o.error, "gate", None)) or {}
        return [d.action, d.sglang, d.evidence, d.verdict, "yes" if d.forced else "no",
                *([", ".join(f"{k} {v['status']}" for k, v in gate.items())] if stages else []), _note(d)]

    return run_on_hosts(
        "deploy",
        selected,
        task,
        FanoutOptions(inventory, hosts, json_out, parallel, fail_fast, accept_new_host_keys, policy),
        columns=["action", "sglang", "evidence", "verdict", "forced", *(["gate"] if stages else []), "note"],
        row=row,
        to_json=to_json,
        extra_json={"release": bundle.release_id, "dry_run": dry_run, "force": force, "gate_stages": stages,
                    "budget": budget_choice, "for_concurrency": for_concurrency},
        while_running=bundle.archive,
        changed=None if dry_run else deploy_changed,
        rollback_command=lambda changed: rollback_command(inventory, source, changed),
        restores=None if dry_run else lambda o: getattr(_deployed(o), "rollback_restores", None),
    )


def server_defaults_by_host(names: list[str], budget: Optional[int | str], level: Optional[int],
                            runs_dir: Optional[Path]) -> dict[str, Any]:
    """host -> ServerDefaults for `--budget` ({} without it); `auto` refuses (exit 3) before any
    host is touched when one of them has no decided recommendation at `level`."""
    from ddtree_ops.deploy_budget import AUTO, auto_defaults, explicit_defaults
    from ddtree_ops.results import runs_root

    if budget is None:
        return {}
    if budget == AUTO:
        assert level is not None  # parse_budget_option requires it
        return {name: auto_defaults(runs_root(runs_dir), name, level) for name in names}
    return {name: explicit_defaults(int(budget)) for name in names}


RollbackSourceOpt = Annotated[Optional[Path], typer.Option(
    "--source", show_default=False,
    help="Checkout whose installer does the rollback on the hosts (default: the one ddtree-ops runs with). "
         "Rarely needed: what is removed comes from each host's own deploy record, not from this checkout.")]


def rollback(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Also remove files changed by hand since deploy (else listed and kept).")
    ] = False,
    source: RollbackSourceOpt = None,
    json_out: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    fail_fast: FailFastOpt = False,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
) -> int:
    """Undo one step on each host, and say which: the last `deploy` (remove exactly what it added, and put back byte
    for byte the release it replaced, if any), or a deploy or rollback that was killed half-way (then only that);
    a file changed since deploy is named and everything kept, unless --force."""
    from ddtree_ops.cli.console import run_on_hosts
    from ddtree_ops.deploy import rollback_host
    from ddtree_ops.release import build_bundle

    _, selected = select_hosts(inventory, hosts)
    bundle = build_bundle(source)

    def task(ctx: Any) -> Any:
        ctx.report("rolling back")
        return rollback_host(ctx.transport, ctx.host, bundle, force=force)

    return run_on_hosts(
        "rollback",
        selected,
        task,
        FanoutOptions(inventory, hosts, json_out, parallel, fail_fast, accept_new_host_keys),
        columns=["action", "step", "removed", "modified"],
        row=lambda o: [o.value.action, o.value.step, str(len(o.value.removed)), str(len(o.value.modified_since_deploy))],
        to_json=lambda outcome: outcome.to_dict(),
    )


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)
    app.command("rollback")(rollback)
