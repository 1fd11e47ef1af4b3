"""Host side of `ddtree-ops deploy` / `rollback`: put the plugin into a Python environment
and take it out again, recording exactly what was added.

Stdlib only, no ddtree import at module level. It runs in the environment's own Python (the
inventory's `python:`), sent on stdin behind ddtree_ops.remote_layout.BOOTSTRAP; the rest of
stdin is one JSON line {"modules": {dotted name: source}, "packages": [names]} carrying the gate's modules from
the release being deployed, which are loaded in memory (nothing written for a dry run).
The caller holds the host lock (WORKDIR/lock) around every operation.

    python -c BOOTSTRAP plan     WORKDIR RELEASE_ID FORCE
    python -c BOOTSTRAP install  WORKDIR RELEASE_ID FORCE
    python -c BOOTSTRAP rollback WORKDIR

What deploy adds to the environment's site-packages (nothing else is touched):
    ddtree_sglang_plugin.pth                       one line: the payload directory
    ddtree_sglang_plugin-0.1.0+<release>.dist-info/ METADATA, entry_points.txt
                                                   (sglang.srt.plugins: ddtree), INSTALLER, RECORD
and under WORKDIR/deployments/<env-key>/: payload-<release>/ddtree (a copy of the release's
package), record.json (what was added, with sha256), journal.json while installing.
A journal found by the next deploy or rollback means an install died half-way: its files are
removed before anything else happens.
"""
import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

DIST_NAME = "ddtree_sglang_plugin"
DIST_VERSION = "0.1.0"
PTH_NAME = DIST_NAME + ".pth"
ENTRY_POINTS = "[sglang.srt.plugins]\nddtree = ddtree.sglang.plugin:register\n"
FAULT_ENV = "DDTREE_DEPLOY_FAULT"  # tests: "after-pth" exits hard mid-install


class InstallError(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


# ---------------------------------------------------------------- small helpers


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path, data):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json(path, document):
    write_atomic(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def read_json(path):
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except FileNotFoundError:
        return None


def site_dir():
    return sysconfig.get_paths()["purelib"]


def env_key(site):
    return hashlib.sha256(os.path.realpath(site).encode("utf-8")).hexdigest()[:16]


def deployment_dir(workdir, site):
    return os.path.join(workdir, "deployments", env_key(site))


class SourceFinder(object):
    """Serves modules from {dotted name: source}; packages are the names listed in
    `packages`. Installed first on sys.meta_path, so nothing on disk is consulted for them."""

    def __init__(self, sources, packages):
        self.sources, self.packages = sources, set(packages)

    def find_spec(self, name, path=None, target=None):
        if name not in self.sources:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=name in self.packages)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = "<release:%s>" % module.__name__
        exec(compile(self.sources[module.__name__], module.__file__, "exec"), module.__dict__)


def load_modules(payload):
    """Make the release's gate importable in memory (payload: {"modules", "packages"})."""
    sys.meta_path.insert(0, SourceFinder(payload["modules"], payload["packages"]))


# ---------------------------------------------------------------- facts


def environment_facts():
    site = site_dir()
    facts = {
        "python": sys.executable,
        "prefix": sys.prefix,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "site_dir": site,
        "site_writable": os.access(site, os.W_OK),
    }
    spec = importlib.util.find_spec("sglang")
    facts["sglang_dir"] = list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None
    ddtree_spec = importlib.util.find_spec("ddtree")
    facts["ddtree_dir"] = (
        list(ddtree_spec.submodule_search_locations)[0]
        if ddtree_spec and ddtree_spec.submodule_search_locations else None
    )
    return facts


def foreign_entry_points():
    from importlib.metadata import entry_points

    return sorted(
        "%s (%s)" % (ep.value, ep.dist.name if ep.dist else "?")
        for ep in entry_points(group="sglang.srt.plugins")
        if ep.name == "ddtree" and not (ep.dist and ep.dist.name.replace("-", "_") == DIST_NAME)
    )


def entry_point_refusal(foreign):
    why = ""
    if any(name.endswith("(ddtree-ops)") for name in foreign):
        why = (" (ddtree-ops itself is installed in this environment and already provides the plugin:"
               " enable it with DDTREE_ENABLE=1, or deploy into an environment without ddtree-ops)")
    return "entry point sglang.srt.plugins:ddtree already declared by %s%s" % (", ".join(foreign), why)


def run_gate(payload, sglang_dir):
    import pathlib

    load_modules(payload)
    from ddtree.sglang.gate import run_gate as gate  # served by SourceFinder

    return gate(pathlib.Path(sglang_dir)).to_dict()


# ---------------------------------------------------------------- what deploy adds


def planned_files(site, release_id):
    dist_info = os.path.join(site, "%s-%s+%s.dist-info" % (DIST_NAME, DIST_VERSION, release_id))
    return {
        "pth": os.path.join(site, PTH_NAME),
        "dist_info": dist_info,
        "files": [os.path.join(site, PTH_NAME)]
        + [os.path.join(dist_info, n) for n in ("METADATA", "entry_points.txt", "INSTALLER", "RECORD")],
    }


def record_line(site, path):
    with open(path, "rb") as handle:
        data = handle.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (os.path.relpath(path, site), digest, len(data))


def write_site_files(site, release_id, payload_dir, plan):
    os.makedirs(plan["dist_info"])
    write_atomic(plan["pth"], (payload_dir + "\n").encode("utf-8"))
    if os.environ.get(FAULT_ENV) == "after-pth":
        os._exit(137)  # a deploy killed half-way (tests)
    metadata = (
        "Metadata-Version: 2.1\nName: %s\nVersion: %s+%s\n"
        "Summary: DDTree speculative decoding plugin for SGLang, deployed by ddtree-ops\n"
        % (DIST_NAME, DIST_VERSION, release_id)
    )
    write_atomic(os.path.join(plan["dist_info"], "METADATA"), metadata.encode())
    write_atomic(os.path.join(plan["dist_info"], "entry_points.txt"), ENTRY_POINTS.encode())
    write_atomic(os.path.join(plan["dist_info"], "INSTALLER"), b"ddtree-ops\n")
    lines = [record_line(site, p) for p in plan["files"][:-1]]
    lines.append("%s,," % os.path.relpath(os.path.join(plan["dist_info"], "RECORD"), site))
    write_atomic(os.path.join(plan["dist_info"], "RECORD"), ("\n".join(lines) + "\n").encode())


def remove_recorded(document):
    """Remove the files and directories a record or journal lists; report what happened."""
    removed, modified, missing = [], [], []
    hashes = document.get("files", {})
    for path in sorted(hashes, key=len, reverse=True):
        if not os.path.lexists(path):
            missing.append(path)
            continue
        if hashes[path] and os.path.isfile(path) and sha256_file(path) != hashes[path]:
            modified.append(path)
        os.unlink(path)
        removed.append(path)
    for directory in sorted(document.get("dirs", []), key=len, reverse=True):
        if os.path.isdir(directory):
            shutil.rmtree(directory)
            removed.append(directory)
    return {"removed": removed, "modified_since_deploy": modified, "already_missing": missing}


def recover(workdir, site):
    """Undo an install that died half-way (journal present). Returns what was removed, or None."""
    journal_path = os.path.join(deployment_dir(workdir, site), "journal.json")
    journal = read_json(journal_path)
    if journal is None:
        return None
    outcome = remove_recorded({"files": {p: "" for p in journal["files"]}, "dirs": journal["dirs"]})
    os.unlink(journal_path)
    return outcome


def verify_in_fresh_interpreter(force):
    argv = [sys.executable, "-m", "ddtree.sglang.probe"] + (["--allow-gate-findings"] if force else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "PYTHONPATH"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave no bytecode behind in site-packages
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd="/", timeout=300)
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        raise InstallError("verify", "fresh interpreter could not run the probe: %s" % " | ".join(tail))
    return result


# ---------------------------------------------------------------- operations


def make_plan(workdir, release_id, force, sources):
    facts = environment_facts()
    site = facts["site_dir"]
    if not facts["sglang_dir"]:
        raise InstallError("no-sglang", "%s: sglang is not installed in this environment" % sys.executable)
    gate = run_gate(sources, facts["sglang_dir"])
    record = read_json(os.path.join(deployment_dir(workdir, site), "record.json"))
    journal = read_json(os.path.join(deployment_dir(workdir, site), "journal.json"))
    plan = planned_files(site, release_id)
    refusals = []
    if not gate["ok"] and not force:
        refusals.append(gate_refusal(gate))
    if not facts["site_writable"]:
        refusals.append("%s: not writable" % site)
    ours = record["payload_dir"] if record else None
    if facts["ddtree_dir"] and (ours is None or not facts["ddtree_dir"].startswith(ours)):
        refusals.append("%s: another `ddtree` package is importable here (%s)" % (sys.executable, facts["ddtree_dir"]))
    foreign = foreign_entry_points()
    if foreign:
        refusals.append(entry_point_refusal(foreign))
    recorded_files = set((record or {}).get("files", {}))
    for path in plan["files"]:
        if os.path.lexists(path) and path not in recorded_files:
            refusals.append("%s: exists and was not added by ddtree-ops" % path)
    if record and record["release"] == release_id and intact(record):
        action = "unchanged"
    elif record:
        action = "replace %s" % record["release"]
    else:
        action = "install"
    return {
        "environment": facts,
        "gate": gate,
        "forced": bool(force and not gate["ok"]),
        "action": action,
        "adds": plan["files"],
        "payload_dir": os.path.join(deployment_dir(workdir, site), "payload-%s" % release_id),
        "interrupted_install": journal is not None,
        "refusals": refusals,
    }


# A refusal names this many gate findings; `deploy --dry-run --force --json` lists them all.
REFUSAL_FINDINGS_SHOWN = 3


def gate_refusal(gate):
    """The gate's findings as one readable refusal: an unsupported version first, then a count
    of the other findings by kind and the first few of them."""
    findings = gate["findings"]
    parts = [f["detail"] for f in findings if f["kind"] == "unknown-version"]
    rest = [f for f in findings if f["kind"] != "unknown-version"]
    if rest:
        kinds = dict.fromkeys(f["kind"] for f in rest)  # in order of first appearance
        counts = ", ".join("%d %s" % (sum(f["kind"] == k for f in rest), k) for k in kinds)
        against = "checked against sglang %s: " % gate.get("manifest_version") if parts else ""
        shown = "; ".join("%s: %s: %s" % (f["file"], f["kind"], f["detail"]) for f in rest[:REFUSAL_FINDINGS_SHOWN])
        more = len(rest) - REFUSAL_FINDINGS_SHOWN
        tail = " (+%d more; `deploy --dry-run --force --json` lists all)" % more if more > 0 else ""
        parts.append("%s%s (%s%s)" % (against, counts, shown, tail))
    return "; ".join(parts) + "; --force deploys anyway (recorded)"


def intact(record):
    return all(os.path.isfile(p) and sha256_file(p) == h for p, h in record["files"].items()) and os.path.isdir(
        record["payload_dir"]
    )


def op_plan(workdir, release_id, force, sources):
    return {"ok": True, "plan": make_plan(workdir, release_id, force == "1", sources)}


def op_install(workdir, release_id, force, sources):
    force = force == "1"
    site = site_dir()
    recovered = recover(workdir, site)
    plan = make_plan(workdir, release_id, force, sources)
    if plan["refusals"]:
        raise InstallError("refused", "refused: " + "; ".join(plan["refusals"]))
    directory = deployment_dir(workdir, site)
    record_path = os.path.join(directory, "record.json")
    if plan["action"] == "unchanged":
        probe = verify_in_fresh_interpreter(force)
        return {"ok": True, "action": "unchanged", "plan": plan, "probe": probe, "recovered": recovered}
    release_src = os.path.join(workdir, "releases", release_id, "src", "ddtree")
    if not os.path.isfile(os.path.join(release_src, "__init__.py")):
        raise InstallError("no-release", "%s: release %s is not on this host" % (workdir, release_id))
    old = read_json(record_path)
    replaced = remove_recorded(old) if old else None
    if old:
        os.unlink(record_path)
    files = planned_files(site, release_id)
    payload_dir = plan["payload_dir"]
    os.makedirs(directory, exist_ok=True)
    write_json(os.path.join(directory, "journal.json"), {
        "release": release_id, "started": time.time(), "files": files["files"],
        "dirs": [files["dist_info"], payload_dir],
    })
    if os.path.isdir(payload_dir):
        shutil.rmtree(payload_dir)
    shutil.copytree(release_src, os.path.join(payload_dir, "ddtree"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    write_site_files(site, release_id, payload_dir, files)
    probe = verify_in_fresh_interpreter(force)
    if probe.get("verdict") == "failed":
        remove_recorded({"files": {p: "" for p in files["files"]}, "dirs": [files["dist_info"], payload_dir]})
        os.unlink(os.path.join(directory, "journal.json"))
        restored = restore_previous(workdir, old, sources)
        raise InstallError("verify", "installed plugin failed its check, removed again%s: %s" % (
            restored, "; ".join(probe.get("reasons", []))))
    record = {
        "release": release_id,
        "python": sys.executable,
        "site_dir": site,
        "payload_dir": payload_dir,
        "files": {p: sha256_file(p) for p in files["files"]},
        "dirs": [files["dist_info"], payload_dir],
        "forced": plan["forced"],
        "gate": plan["gate"],
        "probe": {"verdict": probe.get("verdict"), "reasons": probe.get("reasons")},
        "deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(record_path, record)
    os.unlink(os.path.join(directory, "journal.json"))
    return {"ok": True, "action": "replaced" if old else "installed", "plan": plan, "probe": probe,
            "record": record_path, "recovered": recovered, "replaced": replaced}


def restore_previous(workdir, old, sources):
    """A replacement that failed its check must not leave the environment without the plugin
    it had: reinstall the previous release when its files are still on the host."""
    if not old:
        return ""
    try:
        op_install(workdir, old["release"], "1" if old.get("forced") else "0", sources)
    except InstallError as err:
        return "; the previous release %s could not be restored (%s)" % (old["release"], err)
    return "; previous release %s restored" % old["release"]


def op_rollback(workdir):
    site = site_dir()
    recovered = recover(workdir, site)
    directory = deployment_dir(workdir, site)
    record_path = os.path.join(directory, "record.json")
    record = read_json(record_path)
    if record is None:
        return {"ok": True, "action": "nothing-deployed" if recovered is None else "recovered",
                "recovered": recovered, "site_dir": site}
    removed = remove_recorded(record)
    os.unlink(record_path)
    try:
        os.rmdir(directory)
    except OSError:
        pass
    return {"ok": True, "action": "rolled-back", "release": record["release"], "removed": removed,
            "recovered": recovered, "site_dir": site}


def main(argv):
    sys.dont_write_bytecode = True
    op, workdir, args = argv[0], os.path.abspath(os.path.expanduser(argv[1])), argv[2:]
    if op == "rollback":
        return op_rollback(workdir)
    line = sys.stdin.buffer.readline()
    sources = json.loads(line.decode("utf-8")) if line.strip() else {"modules": {}, "packages": []}
    if op == "plan":
        return op_plan(workdir, args[0], args[1], sources)
    if op == "install":
        return op_install(workdir, args[0], args[1], sources)
    raise InstallError("usage", "unknown operation %r" % op)


def run(argv):
    try:
        reply = main(argv)
        code = 0
    except InstallError as err:
        reply, code = {"ok": False, "kind": err.kind, "error": str(err)}, 1
    except Exception as err:  # noqa: BLE001 - one JSON line, whatever happened
        reply, code = {"ok": False, "kind": "internal", "error": "%s: %s" % (type(err).__name__, err)}, 1
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
