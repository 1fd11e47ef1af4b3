"""`ddtree-ops sglang qualify` and `ddtree-ops sglang diff`: upgrading SGLang without waiting
for a new ddtree-ops.

qualify  on each host (whose SGLang keeps the structure the plugin hooks): deploy the plugin
         for qualification (drifted hashes allowed, recorded), run the `plugin` stage (and
         `sglang-e2e`), and record each host that passed in the qualification file next to
         the inventory: version, file hashes, run id, stages. `deploy` then accepts it. Where the
         code of a pinned file changed (not only its comments), `plugin` alone, a static check,
         is not enough: `sglang-e2e` must pass too (a GPU host, or the CPU test server).
diff     what changed between two SGLang installations in every file the gate checks, by hook.

Exit codes: 0 ok · 2 bad arguments · 3 bad inventory or qualification file · 4 unreachable ·
5 refused or a stage failed · 6 some hosts qualified, others not.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ddtree_ops.cli.options import DEFAULT_PARALLEL, AcceptNewHostKeysOpt, FanoutOptions, HostsOpt, InventoryOpt, \
    JsonOpt, ParallelOpt, SourceOpt
from ddtree_ops.cli.report import RunsDirOpt

QualifiedOpt = Annotated[Optional[Path], typer.Option(
    "--qualified", help="Qualification file (default: sglang-qualified.json next to the inventory).",
    show_default=False)]

sglang_app = typer.Typer(help="SGLang upgrades: qualify a new version on a host, diff two versions.",
                         no_args_is_help=True)


def qualify(
    inventory: InventoryOpt = None,
    hosts: HostsOpt = None,
    qualified: QualifiedOpt = None,
    stages: Annotated[str, typer.Option(
        "--stages", help="Stages that must pass: plugin, and sglang-e2e where the host has a GPU.")] = "plugin,sglang-e2e",
    source: SourceOpt = None,
    runs_dir: RunsDirOpt = None,
    stage_timeout: Annotated[float, typer.Option("--stage-timeout", min=1, help="Seconds per stage.")] = 1800.0,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    accept_new_host_keys: AcceptNewHostKeysOpt = False,
) -> int:
    """Qualify each host's installed SGLang for the plugin and record it in the qualification file."""
    from ddtree_ops.cli.console import run_on_hosts, say
    from ddtree_ops.cli.options import select_hosts
    from ddtree_ops.cli.smoke import parse_stages, run_smoke
    from ddtree_ops.deploy import InstallMode, deploy_host
    from ddtree_ops.errors import DdtreeOpsError, ExitCode, UsageError
    from ddtree_ops.qualification import QUALIFYING_STAGES, add_entry, entry_from_run, load_file
    from ddtree_ops.release import build_bundle
    from ddtree_ops.results import RunStore, new_run_id, runs_root

    stage_list = parse_stages(stages)
    if "plugin" not in stage_list or not set(stage_list) <= set(QUALIFYING_STAGES):
        raise UsageError(f"--stages: expected plugin, optionally with sglang-e2e, got {stages!r}")
    loaded, selected = select_hosts(inventory, hosts)
    qualification = load_file(qualified, loaded.source, create=True)
    bundle = build_bundle(source)
    say(f"qualify: release {bundle.release_id}: deploying for qualification (the structure must hold; "
        f"drifted hashes are allowed and recorded)")

    installed: dict[str, tuple[str, Optional[str]]] = {}  # host -> (sglang package dir, version), as deploy saw it
    code_changed: dict[str, list[str]] = {}  # host -> its pinned files whose code changed, as its gate saw them

    def task(ctx: Any) -> Any:
        ctx.report("deploying")
        outcome = deploy_host(ctx.transport, ctx.host, bundle, qualified=qualification, mode=InstallMode.QUALIFY)
        gate = outcome.gate or {}
        installed[ctx.host.name] = (str(gate.get("package_dir")), gate.get("version"))
        code_changed[ctx.host.name] = changed_code(gate)
        return outcome

    code = run_on_hosts("qualify: deploy", selected, task,
                        FanoutOptions(inventory, hosts, False, parallel, False, accept_new_host_keys),
                        columns=["action", "sglang", "evidence", "verdict"],
                        row=lambda o: [o.value.action, o.value.sglang, o.value.evidence, o.value.verdict],
                        while_running=bundle.archive)
    if code != ExitCode.OK:
        say(f"qualify: nothing recorded (the deploy step did not pass on every host: exit {code})")
        return code
    static_only = {name: files for name, files in code_changed.items() if files and E2E_STAGE not in stage_list}
    for name, files in static_only.items():
        say(f"qualify: {name}: not recorded: code changed in {len(files)} pinned file(s) ({'; '.join(files[:3])}), "
            f"and a static check cannot vouch for changed code: run `--stages plugin,{E2E_STAGE}` on a host with a "
            f"GPU or one prepared as the CPU test server (docs/sglang-plugin.md)")
    if static_only:
        return int(ExitCode.REMOTE)
    run_id = new_run_id()
    code = run_smoke(inventory=inventory, hosts=hosts, stages=stage_list, options={}, keep_going=True,
                     json_out=False, push=True, source=source, stage_timeout_s=stage_timeout, runs_dir=runs_dir,
                     parallel=parallel, accept_new_host_keys=accept_new_host_keys, command="qualify", run_id=run_id)
    run = RunStore(runs_root(runs_dir)).load(run_id)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    recorded = 0
    for host in selected:
        package_dir, version = installed[host.name]
        try:
            hashes, pinned = own_hashes(host, package_dir, version, accept_new_host_keys)
        except DdtreeOpsError as err:
            say(f"qualify: {host.name}: not recorded: {err}")
            continue
        entry, why = entry_from_run(run, host.name, stage_list, bundle.release_id, now, version=version,
                                    hashes=hashes, pinned=pinned, code_changed=code_changed[host.name])
        if entry is None:
            say(f"qualify: {host.name}: not recorded: {why}")
            continue
        qualification = add_entry(qualification, entry)
        recorded += 1
        say(f"qualify: {host.name}: sglang {entry.sglang} qualified by run {run_id} "
            f"({', '.join(f'{k} {v}' for k, v in entry.stages.items())}); recorded in {qualification.path}")
    if code != ExitCode.OK:
        return code
    return int(ExitCode.OK if recorded == len(selected) else ExitCode.PARTIAL if recorded else ExitCode.REMOTE)


E2E_STAGE = "sglang-e2e"


def changed_code(gate: dict[str, Any]) -> list[str]:
    """'file: where it changed' for each pinned file whose code (not only comments) changed, as
    the host's gate judged it; every drifted file when the gate predates that judgement."""
    drifted = {Path(f["file"]).as_posix(): f["detail"].split("; ", 1)[-1] for f in gate.get("findings", [])
               if f.get("kind") == "hash-mismatch"}
    if "code_changed" not in gate:
        return [f"{file}: {detail}" for file, detail in drifted.items()]
    changed = [rel for rel in gate["code_changed"] if isinstance(rel, str)]
    return [next((f"{file}: {d}" for file, d in drifted.items() if file.endswith("/" + rel)), rel) for rel in changed]


def own_hashes(host: Any, package_dir: str, version: Optional[str],
               accept_new_host_keys: bool) -> tuple[dict[str, str], list[str]]:
    """({file: sha256} that ddtree-ops hashed itself, [every file the manifest pins]) of the
    host's SGLang: a qualification vouches for other hosts, so it never takes a host's numbers."""
    from ddtree_ops.errors import RemoteStepError
    from ddtree_ops.pinned_files import hash_pinned_files, manifest_for
    from ddtree_ops.transport.factory import open_transport

    manifest = manifest_for(version)
    if manifest is None:
        raise RemoteStepError(f"{host.name}: no manifest is shipped: nothing pins the files to hash")
    with open_transport(host, accept_new_host_keys=accept_new_host_keys) as transport:
        hashes, missing = hash_pinned_files(transport, host, package_dir, manifest)
    if missing:
        raise RemoteStepError(f"{host.name}: pinned sglang file(s) missing in {package_dir}: {'; '.join(missing[:3])}")
    return hashes, sorted(manifest.file_sha256)


def _package_dir(argument: str, label: str) -> Path:
    """An `sglang` package folder, a folder holding one (site-packages), or a Python
    interpreter whose environment has sglang installed."""
    from ddtree_ops.errors import UsageError

    path = Path(argument)
    for candidate in (path, path / "sglang"):
        if (candidate / "srt").is_dir():
            return candidate
    if path.is_file():
        probe = "import importlib.util as u; s = u.find_spec('sglang'); print(list(s.submodule_search_locations)[0] if s else '')"
        try:
            done = subprocess.run([str(path), "-c", probe], capture_output=True, text=True, timeout=60)
        except OSError as err:
            raise UsageError(f"{label} {argument}: cannot run it as a Python interpreter: {err.strerror or err}") from None
        found = done.stdout.strip()
        if done.returncode == 0 and found and (Path(found) / "srt").is_dir():
            return Path(found)
        raise UsageError(f"{label} {argument}: this Python has no sglang installed")
    raise UsageError(f"{label} {argument}: not an sglang package folder, a folder holding one, or a Python interpreter")


def diff(
    a: Annotated[str, typer.Argument(help="Older SGLang: package folder, site-packages or a python.")],
    b: Annotated[str, typer.Argument(help="Newer SGLang: package folder, site-packages or a python.")],
    json_out: JsonOpt = False,
) -> int:
    """What changed between two SGLang installations in every file the gate checks, by hook."""
    from ddtree.sglang.diff import diff_installations
    from ddtree.sglang.manifests import SUPPORTED, newest

    from ddtree_ops.cli.console import emit_json

    result = diff_installations(_package_dir(a, "A"), _package_dir(b, "B"), newest(SUPPORTED))
    if json_out:
        emit_json(result.to_dict())
        return 0
    lines = [f"sglang {result.version_a} ({result.a}) -> sglang {result.version_b} ({result.b})"]
    for f in result.files:
        if f.state != "changed":
            lines.append(f"  {f.file}: {f.state}")
            continue
        touched = f.hooks_touched
        lines.append(f"  {f.file} ({f.checked_as.value}): changed: {len(touched)} of {len(f.hooks)} hooked definitions"
                     + (f", {len(f.elsewhere)} other definitions" if f.elsewhere else "")
                     + (" (comments or formatting only)" if not touched and not f.elsewhere else ""))
        for hook in touched:
            lines.append(f"    {hook.qualname}: {hook.change.value}" + (f" {hook.detail}" if hook.detail else ""))
        if f.elsewhere:
            shown = ", ".join(f.elsewhere[:6]) + (f" (+{len(f.elsewhere) - 6} more)" if len(f.elsewhere) > 6 else "")
            lines.append(f"    elsewhere: {shown}")
    hooks = result.hooks_touched
    lines.append(f"{len(hooks)} hooked definition(s) changed" + (f": {', '.join(hooks)}" if hooks else ""))
    typer.echo("\n".join(lines))
    return 0


def register(app: typer.Typer) -> None:
    sglang_app.command("qualify")(qualify)
    sglang_app.command("diff")(diff)
    app.add_typer(sglang_app, name="sglang")
