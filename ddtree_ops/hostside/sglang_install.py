"""Host side of `ddtree-ops deploy` / `rollback`: put the plugin into a Python environment
and take it out again, recording exactly what was added.

Stdlib only, no ddtree import at module level. It runs in the environment's own Python (the
inventory's `python:`), sent on stdin behind ddtree_ops.remote_layout.BOOTSTRAP; the rest of
stdin is one JSON line {"modules": {dotted name: source}, "packages": [names]} carrying the gate's modules from
the release being deployed, which are loaded in memory (nothing written for a dry run), and, for
`deploy --budget`, "server_defaults": {"variables": {DDTREE_*: value}, "provenance": {...}}, written
as payload-<release>/ddtree_server_defaults.json (part of the payload's hashes: other defaults are
a `reconfigure`, never `unchanged`); the reply names the defaults it applied.
The caller holds the host lock (WORKDIR/lock) around every operation; install and rollback
also flock the site-packages directory, so workdirs sharing one environment take turns.

    python -c BOOTSTRAP plan     WORKDIR RELEASE_ID MODE
    python -c BOOTSTRAP install  WORKDIR RELEASE_ID MODE
    python -c BOOTSTRAP rollback WORKDIR

MODE: "0" installs when the gate passes: the structure holds and the file hashes match a
shipped manifest or an entry of the operator's qualification file (sent in the payload);
"1" (--force) installs whatever the gate says, recorded; "qualify" (`ddtree-ops sglang
qualify`) installs a structurally sound SGLang whose hashes drifted, recorded, so that its
stages can run.

What deploy adds to the environment's site-packages (nothing else is touched):
    ddtree_sglang_plugin.pth                       one line: the payload directory
    ddtree_sglang_plugin-0.1.0+<release>.dist-info/ METADATA, entry_points.txt
                                                   (sglang.srt.plugins: ddtree), INSTALLER, RECORD
and under WORKDIR/deployments/<env-key>/: payload-<release>/ddtree (a copy of the release's
package; payload-<release>-b when repairing that release in place), record.json (what was added, with sha256), journal.json while installing
or rolling back.
An install is a transaction: the new payload is written next to the live one, the old site
files make way only once it is complete, and the old payload is removed only after the new
deployment passed its check and its record is written. Any failure removes what was added and
rewrites the previous deployment's site files, pointing at its own payload (so pruned
releases do not matter). The journal lists what the install adds and the record it replaces:
the next deploy or rollback that finds it undoes (or, if the record was written, finishes) it.
A rollback writes a journal too ("op": "rollback": what it removes, what it puts back) before
it touches anything, so a rollback killed half-way is finished, once, by the next deploy or
rollback, never left with a mix of two releases' site files (they share the .pth).
record.json also holds the payload's sha256 per file: a redeploy of the same release repairs
a damaged payload or site file instead of calling it `unchanged`.
"""
import base64
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import time

DIST_NAME = "ddtree_sglang_plugin"
DIST_VERSION = "0.1.0"
PTH_NAME = DIST_NAME + ".pth"
ENTRY_POINTS = "[sglang.srt.plugins]\nddtree = ddtree.sglang.plugin:register\n"
FAULT_ENV = "DDTREE_DEPLOY_FAULT"  # tests: the process exits hard at that point (INSTALL_FAULTS, ROLLBACK_FAULTS)
# Every point between two changes an install makes, in order (tests kill it at each one).
INSTALL_FAULTS = ("after-journal", "after-payload", "after-old-site-removed", "after-pth", "after-site-files",
                  "after-probe", "after-record", "after-old-payload-removed")
ROLLBACK_FAULTS = ("rollback-after-journal", "rollback-after-remove", "rollback-after-pth",
                   "rollback-after-site-files", "rollback-after-record")
INSTALLER_TAG = b"ddtree-ops\n"  # dist-info INSTALLER: how a deployment is recognised without its record
# Server defaults (`deploy --budget`) go into the payload next to `ddtree`, where the plugin's
# config reads them (ddtree.sglang.config.DEFAULTS_FILE_NAME: the same name).
DEFAULTS_FILE_NAME = "ddtree_server_defaults.json"


class InstallError(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


# ---------------------------------------------------------------- small helpers


def fault(point):
    """Tests: exit hard here, as a kill -9 would, when FAULT_ENV names this point."""
    if os.environ.get(FAULT_ENV) == point:
        os._exit(137)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


TMP_SUFFIX = ".ddtree-tmp"


def write_atomic(path, data):
    """Replace `path` whole, then check what is there. The temporary file is made by mkstemp
    next to `path` (an unguessable name, O_EXCL: never a file or link someone planted), written,
    fsynced and renamed over `path`. On failure (a full disk) the temporary file is removed
    and the OSError names `path`, never the temporary."""
    import tempfile

    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix="." + name + ".", suffix=TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o644)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OSError(err.errno, err.strerror, path)
    check_written(path, hashlib.sha256(data).hexdigest())


def written_problem(path, digest):
    """None when `path` is a plain file of ours, not a link, holding exactly `digest`; else what it is."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return err.strerror
    if not stat.S_ISREG(st.st_mode):
        return "not a plain file"
    if st.st_uid != os.geteuid():
        return "owned by uid %d" % st.st_uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        return err.strerror
    digest_now = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest_now.update(chunk)
    return None if digest_now.hexdigest() == digest else "its sha256 differs from what was written"


def check_written(path, digest):
    problem = written_problem(path, digest)
    if problem is not None:
        raise InstallError("tampered", "%s: %s, not what deploy wrote: another account is changing this"
                                       " environment" % (path, problem))


def write_json(path, document):
    write_atomic(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode("utf-8"))


READ_MAX = 16 << 20  # bytes: a record is tens of kilobytes


def read_bounded(path, follow=True):
    """A plain file's bytes (at most READ_MAX, never blocking on a FIFO; with follow=False
    never through a link), None when it is absent; OSError naming it otherwise."""
    import errno

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a plain file", path)
        data = handle.read(READ_MAX + 1)
    if len(data) > READ_MAX:
        raise OSError(errno.EFBIG, "larger than %d bytes" % READ_MAX, path)
    return data


def read_json(path):
    """A record or journal (never read through a link), or None when there is none. One that
    deploy did not write (not JSON, nested past the stack, fields of other types) is refused
    naming the file: nothing is removed on the word of a file we cannot read."""
    try:
        data = read_bounded(path, follow=False)
        if data is None:
            return None
        document = json.loads(data.decode("utf-8"))
    except OSError as err:
        raise InstallError("corrupt", "%s: %s; not a record deploy wrote, so nothing was changed: move it out of"
                                      " the way" % (path, err.strerror or err))
    except (ValueError, RecursionError) as err:
        raise InstallError("corrupt", "%s: not JSON deploy wrote (%s); nothing was changed: move it out of the way"
                                      % (path, type(err).__name__))
    problem = document_problem(document)
    if problem is not None:
        raise InstallError("corrupt", "%s: %s: not a record deploy wrote; nothing was changed: move it out of the"
                                      " way" % (path, problem))
    return document


def document_problem(document, where="", depth=0):
    """Why a record or journal is not one deploy writes (its fields' types), or None."""
    def strings(value):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    def string_map(value):
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())

    if not isinstance(document, dict):
        return "%sexpected an object" % where
    checks = (("release", lambda v: isinstance(v, str)), ("files", lambda v: string_map(v) or strings(v)),
              ("dirs", strings), ("payload_dir", lambda v: isinstance(v, str)),
              ("payload_files", lambda v: v is None or string_map(v)),
              ("server_defaults", lambda v: v is None or string_map(v)),
              ("previous", lambda v: v is None or isinstance(v, dict)))
    for key, ok in checks:
        if key in document and not ok(document[key]):
            return "%s%s: not what deploy writes" % (where, key)
    if document.get("previous") is not None:
        if depth > 2:
            return "%sprevious: nested deeper than deploy writes" % where
        return document_problem(document["previous"], "%sprevious." % where, depth + 1)
    return None


def read_text(path):
    """A small text file deploy reads (a .pth, a dist-info's INSTALLER or RECORD), or None when
    it is absent or not a plain file of at most READ_MAX bytes (never blocking on a FIFO)."""
    try:
        data = read_bounded(path)
    except OSError:
        return None
    return None if data is None else data.decode("utf-8", "replace")


def os_error_line(err):
    """One line naming the file an OSError is about (the destination, for a copy)."""
    path = getattr(err, "filename2", None) or err.filename
    return "%s: %s" % (path, err.strerror or err) if path else str(err)


def site_dir():
    return sysconfig.get_paths()["purelib"]


def env_key(site):
    return hashlib.sha256(os.path.realpath(site).encode("utf-8")).hexdigest()[:16]


def deployment_dir(workdir, site):
    return os.path.join(workdir, "deployments", env_key(site))


DEFAULT_ENV_LOCK_WAIT_S = 60.0


class EnvironmentLock(object):
    """flock() on the site-packages directory itself: deploys and rollbacks from different
    workdirs into one environment take turns (WORKDIR/lock only serialises one workdir).
    A directory fd can be flocked, so the environment gains no lock file."""

    def __init__(self, site, wait_s):
        self.site, self.wait_s, self.fd = site, float(wait_s), None

    def __enter__(self):
        import errno
        import fcntl

        self.fd = os.open(self.site, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise InstallError("locked", "%s: another deploy or rollback is changing this environment"
                                                 " (waited %gs)" % (self.site, self.wait_s))
                time.sleep(0.1)

    def __exit__(self, *exc):
        os.close(self.fd)  # closing drops the flock


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
    """What the plan checks about this environment, read now: the caller holds the environment
    lock, and what another deploy changed while this one waited counts (see import_path)."""
    site = site_dir()
    facts = {
        "python": sys.executable,
        "prefix": sys.prefix,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "site_dir": site,
        "site_writable": os.access(site, os.W_OK),
    }
    path = import_path(site)
    facts["sglang_dir"] = package_dir_on(path, "sglang")
    facts["ddtree_dir"] = package_dir_on(path, "ddtree")
    return facts


def import_path(site):
    """sys.path as a fresh interpreter of this environment has it now. This process read the
    .pth files when it started, maybe before it waited for the lock while another deploy
    switched ours to another payload: the payload folders it added then (any workdir's) are
    replaced by the one our .pth names now, where site would put it (appended)."""
    path = [p for p in sys.path if not (p and owning_workdir(p))]
    pth = os.path.join(site, PTH_NAME)
    if os.path.isfile(pth) and not os.path.islink(pth):
        line = ((read_text(pth) or "").strip().splitlines() or [""])[0].strip()
        if line and os.path.isdir(line) and line not in path:
            path.append(line)
    return path


def package_dir_on(path, name):
    """Where `import name` would find the package on `path` (the first match; nothing that
    this process imported or serves from memory counts), or None."""
    import importlib.machinery

    importlib.invalidate_caches()  # a directory listing cached before the lock is stale too
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def foreign_entry_points(path=None):
    """Other distributions that declare sglang.srt.plugins:ddtree on `path` (default sys.path)."""
    from importlib.metadata import distributions

    found = []
    for dist in distributions(path=list(sys.path if path is None else path)):
        name = (dist.metadata["Name"] or "?") if dist.metadata else "?"
        if name.replace("-", "_") == DIST_NAME:
            continue
        found += ["%s (%s)" % (ep.value, name) for ep in dist.entry_points
                  if ep.group == "sglang.srt.plugins" and ep.name == "ddtree"]
    return sorted(set(found))


def entry_point_refusal(foreign):
    why = ""
    if any(name.endswith("(ddtree-ops)") for name in foreign):
        why = (" (ddtree-ops itself is installed in this environment and already provides the plugin:"
               " enable it with DDTREE_ENABLE=1, or deploy into an environment without ddtree-ops)")
    return "entry point sglang.srt.plugins:ddtree already declared by %s%s" % (", ".join(foreign), why)


FORCE, QUALIFY = "1", "qualify"  # install modes besides "0" (see the module doc)


def run_gate(payload, sglang_dir):
    """The release's gate on this SGLang: both levels of evidence, and the qualification
    entry that vouches for drifted hashes, if one does."""
    import pathlib

    load_modules(payload)
    from ddtree.sglang.gate import run_gate as gate  # served by SourceFinder
    from ddtree.sglang.manifests import parse_manifests
    from ddtree.sglang.qualification import parse as parse_qualifications

    qualifications = parse_qualifications(json.dumps({"qualified": payload.get("qualified", [])}),
                                          payload.get("qualified_source", "qualification file"))
    return gate(pathlib.Path(sglang_dir), parse_manifests(payload.get("manifests", {})),
                qualifications=qualifications, worker=payload.get("worker"),
                tree_round=payload.get("tree_round")).to_dict()


# ---------------------------------------------------------------- what deploy adds


def planned_files(site, release_id):
    dist_info = os.path.join(site, "%s-%s+%s.dist-info" % (DIST_NAME, DIST_VERSION, release_id))
    return {
        "pth": os.path.join(site, PTH_NAME),
        "dist_info": dist_info,
        "files": [os.path.join(site, PTH_NAME)]
        + [os.path.join(dist_info, n) for n in ("METADATA", "entry_points.txt", "INSTALLER", "RECORD")],
    }


def record_line(site, path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (os.path.relpath(path, site), digest, len(data))


def site_file_contents(site, release_id, payload_dir, plan):
    """{path: bytes} of a deployment's .pth and dist-info, in plan order. Deterministic in
    (site, release, payload dir): a failed upgrade puts the previous deployment back byte for
    byte, and a deployment whose record is lost can still be checked before it is removed."""
    metadata = (
        "Metadata-Version: 2.1\nName: %s\nVersion: %s+%s\n"
        "Summary: DDTree speculative decoding plugin for SGLang, deployed by ddtree-ops\n"
        % (DIST_NAME, DIST_VERSION, release_id)
    )
    pth, metadata_path, entry_points, installer, record = plan["files"]
    contents = {pth: (payload_dir + "\n").encode("utf-8"), metadata_path: metadata.encode(),
                entry_points: ENTRY_POINTS.encode(), installer: INSTALLER_TAG}
    lines = [record_line(site, path, data) for path, data in contents.items()]
    lines.append("%s,," % os.path.relpath(record, site))
    contents[record] = ("\n".join(lines) + "\n").encode()
    return contents


def write_site_files(site, release_id, payload_dir, plan, fault_point="after-pth"):
    """Write the .pth and dist-info of a deployment (see site_file_contents); returns
    {path: sha256} of what was written. `fault_point`: the FAULT_ENV value that kills the
    process right after the .pth is written (tests), or None."""
    make_own_dir(plan["dist_info"])
    contents = site_file_contents(site, release_id, payload_dir, plan)
    for path, data in contents.items():
        write_atomic(path, data)
        if fault_point and path == plan["pth"]:
            fault(fault_point)
    return dict((path, hashlib.sha256(data).hexdigest()) for path, data in contents.items())


def make_own_dir(path):
    """A folder deploy writes into: made if absent; a real folder of ours that no one else can write."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise InstallError("tampered", "%s: not a folder of ours that only we can write (%s, uid %d, mode %04o);"
                                       " move it out of the way" % (
                                           path, "symlink" if stat.S_ISLNK(st.st_mode) else "folder"
                                           if stat.S_ISDIR(st.st_mode) else "file", st.st_uid, stat.S_IMODE(st.st_mode)))


def next_payload_dir(directory, release_id, record):
    """Where a new payload goes: never the directory the live deployment runs from (a repair
    of the same release included), so the old one stays usable until the new one passed."""
    for suffix in ("", "-b"):
        candidate = os.path.join(directory, "payload-%s%s" % (release_id, suffix))
        if not record or candidate != record.get("payload_dir"):
            return candidate
    raise AssertionError("unreachable")


def copy_payload(release_src, payload_dir):
    """Copy the release's `ddtree` package; returns {path relative to payload_dir: sha256}.
    An error names the file being written."""
    hashes = {}
    for root, dirs, files in os.walk(release_src):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        target_root = os.path.join(payload_dir, "ddtree", os.path.relpath(root, release_src))
        os.makedirs(target_root, mode=0o755, exist_ok=True)
        for name in sorted(files):
            if name.endswith(".pyc"):
                continue
            with open(os.path.join(root, name), "rb") as handle:
                data = handle.read()
            target = os.path.normpath(os.path.join(target_root, name))
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                with os.fdopen(os.open(target, flags, 0o644), "wb") as handle:
                    handle.write(data)
            except OSError as err:
                raise OSError(err.errno, err.strerror, target)
            hashes[os.path.relpath(target, payload_dir).replace(os.sep, "/")] = hashlib.sha256(data).hexdigest()
    return hashes


def server_defaults_bytes(sources):
    """The defaults file the operator asked for (stdin's "server_defaults"), or None."""
    wanted = sources.get("server_defaults")
    return None if wanted is None else (json.dumps(wanted, indent=1, sort_keys=True) + "\n").encode("utf-8")


DEFAULTS_READ_MAX = 1 << 16  # a defaults file deploy writes is a few hundred bytes


def defaults_of(document):
    """The server-default variables a deployment (record or journal) was made with, for the
    reply ({} none, None unknown): its own field, or (a record from an older installer) its
    payload's defaults file."""
    if not document:
        return None
    if "server_defaults" in document:
        return document["server_defaults"] or {}
    if not document.get("payload_dir"):
        return None
    path = os.path.join(document["payload_dir"], DEFAULTS_FILE_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return {}
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        data = handle.read(DEFAULTS_READ_MAX + 1)
    try:
        variables = json.loads(data.decode("utf-8")).get("variables") if len(data) <= DEFAULTS_READ_MAX else None
    except (ValueError, RecursionError, AttributeError):
        return None
    return variables if isinstance(variables, dict) else None


def defaults_changed(record, wanted):
    """Whether the recorded payload carries other server defaults than `wanted` (bytes or None)."""
    recorded = (record.get("payload_files") or {}).get(DEFAULTS_FILE_NAME)
    return recorded != (None if wanted is None else hashlib.sha256(wanted).hexdigest())


def write_server_defaults(payload_dir, wanted, payload_files):
    """Write the defaults file into a fresh payload and add it to the payload's hashes."""
    if wanted is not None:
        path = os.path.join(payload_dir, DEFAULTS_FILE_NAME)
        write_atomic(path, wanted)
        payload_files[DEFAULTS_FILE_NAME] = hashlib.sha256(wanted).hexdigest()


def payload_hashes(payload_dir):
    """{relative path: sha256} of a payload as it is now (bytecode SGLang may write is not part of it)."""
    found = {}
    for root, dirs, files in os.walk(payload_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".pyc"):
                path = os.path.join(root, name)
                found[os.path.relpath(path, payload_dir).replace(os.sep, "/")] = sha256_file(path)
    return found


def site_files_intact(record):
    return all(written_problem(p, h) is None for p, h in record["files"].items())


def payload_intact(record):
    """The payload matches the hashes recorded at install (a record without them cannot be trusted)."""
    expected = record.get("payload_files")
    return expected is not None and os.path.isdir(record["payload_dir"]) \
        and payload_hashes(record["payload_dir"]) == expected


# ---------------------------------------------------------------- the install's footprint

DIST_INFO_FILES = ("METADATA", "entry_points.txt", "INSTALLER", "RECORD")


def is_dist_info_dir(path, site):
    name = os.path.basename(path)
    return os.path.dirname(path) == site and name.startswith(DIST_NAME + "-") and name.endswith(".dist-info")


def in_footprint(path, site, workdir):
    """True when `path` is a place deploy writes: site/<.pth>, one of our dist-info folders in
    site (or a file deploy puts there), or a payload folder under this workdir's deployment
    folder for this environment. A record names paths; only these may be removed."""
    if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) != path:
        return False
    parent, name = os.path.split(path)
    if parent == site and name == PTH_NAME:
        return True
    if is_dist_info_dir(path, site) or (is_dist_info_dir(parent, site) and name in DIST_INFO_FILES):
        return True
    return parent == deployment_dir(workdir, site) and name.startswith("payload-") and len(name) > len("payload-")


def check_footprint(document, site, workdir, what):
    """Refuse (before anything is removed) a record or journal that names a path deploy never writes."""
    paths = list(document.get("files", {})) + list(document.get("dirs", []))
    if document.get("payload_dir"):
        paths.append(document["payload_dir"])
    if (document.get("previous") or {}).get("payload_dir"):  # what a rollback would put back
        paths.append(document["previous"]["payload_dir"])
    outside = [p for p in paths if not in_footprint(p, site, workdir)]
    if outside:
        raise InstallError("refused", "%s lists %s, outside what deploy adds (%s in %s, our dist-info there, payloads"
                                      " under %s); nothing removed" % (
                                          what, ", ".join(repr(p) for p in outside[:3]), PTH_NAME, site,
                                          deployment_dir(workdir, site)))


def changed_since_deploy(record):
    """["path (why)"] for what rollback would remove that is not as deploy left it: a site file
    whose hash differs or that is no longer a plain file, a payload file edited, added or
    replaced by a link, anything added to our dist-info folder. Bytecode caches do not count."""
    changed = []
    hashes = record.get("files", {})
    for path in sorted(hashes):
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) or not os.path.isfile(path):
            changed.append("%s (no longer a plain file)" % path)
        elif not hashes[path]:
            changed.append("%s (no hash recorded to check it against)" % path)
        elif sha256_file(path) != hashes[path]:
            changed.append("%s (edited)" % path)
    for directory in sorted(record.get("dirs", [])):
        if os.path.islink(directory) or not os.path.isdir(directory):
            continue
        expected = record.get("payload_files") if directory == record.get("payload_dir") else \
            {os.path.relpath(p, directory): None for p in hashes if os.path.dirname(p) == directory}
        if expected is None:
            changed.append("%s (no hashes recorded to check it against)" % directory)
            continue
        for root, dirs, files in os.walk(directory):
            in_cache = os.path.basename(root) == "__pycache__"
            for name in sorted(dirs + files):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, directory).replace(os.sep, "/")
                if os.path.islink(path):
                    changed.append("%s (a link)" % path)
                elif name in files and not (in_cache and name.endswith(".pyc")):
                    if rel not in expected:
                        changed.append("%s (added)" % path)
                    elif expected[rel] is not None and sha256_file(path) != expected[rel]:
                        changed.append("%s (edited)" % path)
    return changed


def remove_recorded(document):
    """Remove the files and directories a record or journal lists (the caller checked they are
    in the footprint); report what happened. A link is removed, never followed."""
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
        if os.path.islink(directory):
            os.unlink(directory)
            removed.append(directory)
        elif os.path.isdir(directory):
            shutil.rmtree(directory)
            removed.append(directory)
    return {"removed": removed, "modified_since_deploy": modified, "already_missing": missing}


def site_part(record):
    """A record's files and dirs in site-packages, without its payload."""
    return {"files": record["files"], "dirs": [d for d in record["dirs"] if d != record["payload_dir"]]}


def restore_previous(site, previous):
    """Put the previous deployment's site files back, pointing at its own payload (which an
    install never touches; pruned releases do not matter). Returns a clause for the message;
    raises OSError if the files cannot be written."""
    if not previous:
        return ""
    if not os.path.isdir(previous["payload_dir"]):
        return "; the previous release %s cannot be put back: %s is gone" % (
            previous["release"], previous["payload_dir"])
    write_site_files(site, previous["release"], previous["payload_dir"],
                     planned_files(site, previous["release"]), fault_point=None)
    return "; previous release %s restored" % previous["release"]


def undo_install(site, journal, journal_path):
    """Remove what an unfinished install added and restore the deployment it was replacing.
    The journal stays if that fails, so the next deploy or rollback tries again."""
    outcome = remove_recorded({"files": {p: "" for p in journal["files"]}, "dirs": journal["dirs"]})
    try:
        clause = restore_previous(site, journal.get("previous"))
    except OSError as err:
        return outcome, "; the previous release %s could not be put back (%s); the next deploy or rollback" \
                        " retries" % (journal["previous"]["release"], os_error_line(err))
    os.unlink(journal_path)
    outcome["restored"] = (journal.get("previous") or {}).get("release") if clause.startswith("; previous") else None
    return outcome, clause


def kept_for_rollback(old):
    """What the record of an install over `old` keeps for `rollback` to put back: `old` itself
    when it is intact (its payload and site files as recorded), without its own history, so a
    rollback goes back one deployment, as a package manager's downgrade does; a damaged `old`
    (a repair) passes on what it kept. None: rollback then removes everything."""
    if not old:
        return None
    if payload_intact(old) and site_files_intact(old):
        return dict(old, previous=None)  # what a rollback to it can put back in turn: nothing
    return old.get("previous")


def payload_dirs(record):
    """The payload folders a record needs: its own, and the one its rollback puts back."""
    if not record:
        return set()
    return {record["payload_dir"]} | ({record["previous"]["payload_dir"]} if record.get("previous") else set())


def finish_commit(directory, record, previous):
    """After the new record is written: the payloads the replaced record needed and the new
    one does not (what fell out of the rollback history) are no longer needed."""
    for payload_dir in sorted(payload_dirs(previous) - payload_dirs(record)):
        if os.path.isdir(payload_dir) and not os.path.islink(payload_dir):
            shutil.rmtree(payload_dir)
    fault("after-old-payload-removed")
    os.unlink(os.path.join(directory, "journal.json"))


def is_stray_temporary(site, name):
    """A .pth temporary a killed deploy left (this installer's name, or an older one's), ours."""
    ours = name.startswith("." + PTH_NAME + ".") and name.endswith(TMP_SUFFIX) or name.startswith(PTH_NAME + ".tmp-")
    if not ours:
        return False
    st = os.lstat(os.path.join(site, name))
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def recover(workdir, site):
    """Finish or undo an install that died half-way (journal present): if its record was
    written it only finishes the cleanup, else it removes what the install added and puts
    the previous deployment back. Also removes a .pth temporary a crash left. Returns what
    was removed, or None."""
    directory = deployment_dir(workdir, site)
    journal_path = os.path.join(directory, "journal.json")
    strays = [os.path.join(site, n) for n in sorted(os.listdir(site)) if is_stray_temporary(site, n)]
    for path in strays:
        os.unlink(path)
    journal = read_json(journal_path)
    if journal is None:
        return {"removed": strays, "modified_since_deploy": [], "already_missing": []} if strays else None
    check_footprint({"files": dict.fromkeys(journal["files"], ""), "dirs": journal["dirs"]}, site, workdir, journal_path)
    if journal.get("previous"):
        check_footprint(journal["previous"], site, workdir, journal_path)
    if journal.get("op") == "rollback":
        outcome = finish_rollback(site, directory, journal)
        outcome["removed"] = strays + outcome["removed"]
        outcome["modified_since_deploy"] = []  # judged when the rollback began; the .pth may hold either release's line
        return outcome
    record = read_json(os.path.join(directory, "record.json"))
    if record:
        check_footprint(record, site, workdir, os.path.join(directory, "record.json"))
    if record and record["release"] == journal["release"] and record["payload_dir"] in journal["dirs"]:
        finish_commit(directory, record, journal.get("previous"))
        return {"removed": strays, "modified_since_deploy": [], "already_missing": [], "completed": True}
    outcome, clause = undo_install(site, journal, journal_path)
    if os.path.exists(journal_path):
        raise InstallError("recover", "%s: an interrupted install could not be undone%s" % (journal_path, clause))
    outcome["removed"] = strays + outcome["removed"]
    outcome.update(interrupted_deploy=journal["release"], release_defaults=journal.get("server_defaults"),
                   restored_defaults=defaults_of(journal.get("previous")) if outcome.get("restored") else None)
    return outcome


def verify_in_fresh_interpreter(force, gate, qualifying=False):
    """The deployed plugin loaded by SGLang's load_plugins() in a fresh interpreter (the probe).
    `gate`: this deploy's gate report, made with the same release moments ago under the host
    lock: the probe takes it rather than parse SGLang's files again. A gated deploy (neither
    forced nor qualifying) has the probe import nothing the gate did not accept."""
    argv = [sys.executable, "-m", "ddtree.sglang.probe", "--gate-report", "-"]
    argv += ["--allow-gate-findings"] if force else [] if qualifying else ["--require-gate-ok"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "PYTHONPATH"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave no bytecode behind in site-packages
    done = subprocess.run(argv, input=json.dumps(gate).encode("utf-8"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env, cwd="/", timeout=300)
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        raise InstallError("verify", "fresh interpreter could not run the probe: %s" % " | ".join(tail))
    return result


# ---------------------------------------------------------------- who owns what is there


def owning_workdir(payload_dir):
    """WORKDIR of a payload path WORKDIR/deployments/<env-key>/payload-<release>, else None."""
    deployments = os.path.dirname(os.path.dirname(payload_dir))
    if os.path.basename(payload_dir).startswith("payload-") and os.path.basename(deployments) == "deployments":
        return os.path.dirname(deployments)
    return None


def unlisted_deployment(site, listed_files, listed_dirs):
    """The plugin's files in site-packages that this workdir's record and journal do not list:
    {"pth", "dist_infos", "installers", "payload_dir", "workdir", "release"} or None."""
    import glob

    dist_infos = [d for d in sorted(glob.glob(os.path.join(site, DIST_NAME + "-*.dist-info")))
                  if d not in listed_dirs]
    pth = os.path.join(site, PTH_NAME)
    pth = pth if os.path.lexists(pth) and pth not in listed_files else None
    if not dist_infos and not pth:
        return None
    payload_dir = ((read_text(pth) or "").strip().splitlines() or [""])[0] if pth else ""
    installers = sorted(set((read_text(os.path.join(d, "INSTALLER")) or "?").strip() for d in dist_infos))
    release = None
    if dist_infos:
        release = os.path.basename(dist_infos[0])[len(DIST_NAME) + 1:-len(".dist-info")].split("+")[-1]
    return {"pth": pth, "dist_infos": dist_infos, "installers": installers, "payload_dir": payload_dir,
            "workdir": owning_workdir(payload_dir) if payload_dir else None, "release": release}


def ours_elsewhere(found):
    """True when what is there was written by ddtree-ops (INSTALLER, or the .pth's payload path)."""
    if found["dist_infos"]:
        return found["installers"] == [INSTALLER_TAG.decode().strip()]
    return found["workdir"] is not None


def ownership_refusal(found, workdir, site):
    """One line: whose deployment is in the way, and the way out."""
    what = "release %s" % found["release"] if found["release"] else "the plugin"
    uninstall = "`pip uninstall %s` with %s" % (DIST_NAME, sys.executable)
    owner = found["workdir"]
    if owner is None:
        return "%s: %s was added by ddtree-ops from an unknown workdir (%s); remove it with %s" % (
            site, what, found["pth"] or found["dist_infos"][0], uninstall)
    record = os.path.join(deployment_dir(owner, site), "record.json")
    if owner == workdir:
        return ("%s: %s was deployed here from this workdir but its record %s is gone; `ddtree-ops rollback`"
                " removes it (or %s)" % (site, what, record, uninstall))
    gone = "" if os.path.isfile(record) else " (its record %s is gone)" % record
    return ("%s: %s is deployed here by ddtree-ops from workdir %s%s; roll it back from there (`ddtree-ops"
            " rollback` with that workdir) or %s, then deploy again" % (site, what, owner, gone, uninstall))


# ---------------------------------------------------------------- operations


def shared_site_problem(site):
    """Why another account could change what deploy writes into `site`, or None."""
    st = os.stat(site)
    if st.st_uid not in (0, os.geteuid()):
        return "owned by uid %d" % st.st_uid
    if st.st_mode & 0o022:
        return "writable by group or others (mode %04o)" % stat.S_IMODE(st.st_mode)
    return None


def make_plan(workdir, release_id, mode, sources, allow_shared_env=False):
    facts = environment_facts()
    site = facts["site_dir"]
    if not facts["sglang_dir"]:
        raise InstallError("no-sglang", "%s: sglang is not installed in this environment" % sys.executable)
    gate = run_gate(sources, facts["sglang_dir"])
    directory = deployment_dir(workdir, site)
    record = read_json(os.path.join(directory, "record.json"))
    journal = read_json(os.path.join(directory, "journal.json"))
    plan = planned_files(site, release_id)
    # What this workdir added: its record, and what an interrupted install's journal lists
    # (a deploy removes that first, so a dry run must not call it someone else's).
    listed_files = set((record or {}).get("files", {})) | set((journal or {}).get("files", []))
    listed_dirs = set((record or {}).get("dirs", [])) | set((journal or {}).get("dirs", []))
    refusals = []
    force = mode == FORCE
    if not force and not gate["structure_ok"]:
        refusals.append(gate_refusal(gate))
    elif mode not in (FORCE, QUALIFY) and not gate["ok"]:
        refusals.append(gate_refusal(gate))
    if not facts["site_writable"]:
        refusals.append("%s: not writable" % site)
    shared = shared_site_problem(site)
    if shared and not allow_shared_env:
        refusals.append("%s: %s: another account could replace what deploy writes there; --allow-shared-env"
                        " deploys anyway" % (site, shared))
    found = unlisted_deployment(site, listed_files, listed_dirs)
    ddtree_dir = facts["ddtree_dir"]
    ours = [d for d in listed_dirs if os.path.basename(d).startswith("payload-")]
    if found and found["payload_dir"]:
        ours.append(found["payload_dir"])  # reported below as the deployment in the way
    if ddtree_dir and not any(ddtree_dir.startswith(d + os.sep) for d in ours):
        refusals.append("%s: another `ddtree` package is importable here (%s)" % (sys.executable, ddtree_dir))
    foreign = foreign_entry_points(import_path(site))
    if foreign:
        refusals.append(entry_point_refusal(foreign))
    if found and ours_elsewhere(found):
        refusals.append(ownership_refusal(found, workdir, site))
    elif found:
        installers = " (INSTALLER: %s)" % ", ".join(found["installers"]) if found["installers"] else ""
        for path in ([found["pth"]] if found["pth"] else []) + found["dist_infos"]:
            refusals.append("%s: exists and was not added by ddtree-ops%s" % (path, installers))
    if record and record["release"] == release_id:
        healthy = payload_intact(record) and (journal is not None or site_files_intact(record))
        action = "unchanged" if healthy else "repair"
        if action == "unchanged" and defaults_changed(record, server_defaults_bytes(sources)):
            action = "reconfigure"
    elif record:
        action = "replace %s" % record["release"]
    else:
        action = "install"
    if journal is not None:
        action = "recover, then " + action
    return {
        "environment": facts,
        "gate": gate,
        "forced": bool(force and not gate["ok"]),
        "qualifying": mode == QUALIFY,
        "action": action,
        "adds": plan["files"],
        "payload_dir": next_payload_dir(directory, release_id, record),
        "interrupted_install": journal is not None,
        "refusals": refusals,
        "server_defaults": sources.get("server_defaults"),
    }


# A refusal names this many gate findings; `deploy --dry-run --force --json` lists them all.
REFUSAL_FINDINGS_SHOWN = 3


def gate_refusal(gate):
    """The gate's verdict as one readable refusal. A structure that differs names the hooks
    (the way out is a plugin change); drifted hashes alone name the files and where each
    changed (the way out is to qualify the version)."""
    findings = gate["findings"]
    version = gate.get("version") or "(version unreadable)"
    against = gate.get("manifest_version")
    if not gate["structure_ok"]:
        shown = [f for f in findings if f.get("evidence", "structure") == "structure"]
        hooks = gate.get("broken_hooks") or [f["detail"] for f in shown]
        first = "; ".join("%s: %s: %s" % (f["file"], f["kind"], f["detail"]) for f in shown[:REFUSAL_FINDINGS_SHOWN])
        more = len(shown) - REFUSAL_FINDINGS_SHOWN
        tail = " (+%d more; `deploy --dry-run --force --json` lists all)" % more if more > 0 else ""
        return ("sglang %s: structure differs from sglang %s in %d hook(s): %s (%s%s); the plugin does not"
                " support this SGLang; --force deploys anyway (recorded)" % (
                    version, against, len(hooks), ", ".join(hooks), first, tail))
    drifted = [f for f in findings if f["kind"] == "hash-mismatch"]
    if drifted:
        what = "; ".join("%s: %s" % (f["file"], f["detail"].split("; ", 1)[-1]) for f in drifted[:REFUSAL_FINDINGS_SHOWN])
        more = len(drifted) - REFUSAL_FINDINGS_SHOWN
        tail = " (+%d more; `ddtree-ops sglang diff` shows each hook)" % more if more > 0 else ""
        files = "%d pinned file(s) differ from sglang %s: %s%s" % (len(drifted), against, what, tail)
    else:
        files = "its pinned files match sglang %s" % against
    note = "; %s" % gate["qualification_note"] if gate.get("qualification_note") else ""
    return ("sglang %s: %s: %s%s; qualify it with `ddtree-ops sglang qualify`, or --force deploys anyway"
            " (recorded)" % (version, gate.get("verdict", "not pinned"), files, note))


def op_plan(workdir, release_id, mode, sources, allow_shared_env=False):
    return {"ok": True, "plan": make_plan(workdir, release_id, mode, sources, allow_shared_env)}


def with_environment_lock(lock_wait, operation, *args):
    """Run an operation under the environment lock; an OSError becomes one line naming its file."""
    site = site_dir()
    with EnvironmentLock(site, DEFAULT_ENV_LOCK_WAIT_S if lock_wait is None else lock_wait):
        try:
            return operation(site, *args)
        except OSError as err:
            raise InstallError("os-error", os_error_line(err))


def op_install(workdir, release_id, force, sources, lock_wait=None, allow_shared_env=False):
    return with_environment_lock(lock_wait, install_locked, workdir, release_id, force, sources, allow_shared_env)


def install_locked(site, workdir, release_id, mode, sources, allow_shared_env=False):
    force = mode == FORCE
    recovered = recover(workdir, site)
    plan = make_plan(workdir, release_id, mode, sources, allow_shared_env)
    if plan["refusals"]:
        raise InstallError("refused", "refused: " + "; ".join(plan["refusals"]))
    directory = deployment_dir(workdir, site)
    record_path = os.path.join(directory, "record.json")
    old = read_json(record_path)
    if old:
        check_footprint(old, site, workdir, record_path)
    if plan["action"] == "unchanged":
        return verify_unchanged(record_path, old, plan, force, recovered)
    release_src = os.path.join(workdir, "releases", release_id, "src", "ddtree")
    if not os.path.isfile(os.path.join(release_src, "__init__.py")):
        raise InstallError("no-release", "%s: release %s is not on this host" % (workdir, release_id))
    files = planned_files(site, release_id)
    payload_dir = plan["payload_dir"]
    journal_path = os.path.join(directory, "journal.json")
    journal = {"release": release_id, "started": time.time(), "files": files["files"],
               "dirs": [files["dist_info"], payload_dir], "previous": old,
               "server_defaults": (sources.get("server_defaults") or {}).get("variables")}
    make_own_dir(directory)
    write_json(journal_path, journal)
    fault("after-journal")
    replaced = None
    previous = kept_for_rollback(old)  # judged before the old site files make way
    try:
        # The new payload goes next to the old one; the old site files make way only once
        # it is complete, and the old payload stays until the new deployment passed its check.
        if os.path.isdir(payload_dir):
            shutil.rmtree(payload_dir)  # a leftover that no record names
        payload_files = copy_payload(release_src, payload_dir)
        write_server_defaults(payload_dir, server_defaults_bytes(sources), payload_files)
        fault("after-payload")
        if old:
            replaced = remove_recorded(site_part(old))
        fault("after-old-site-removed")
        site_hashes = write_site_files(site, release_id, payload_dir, files)
        fault("after-site-files")
        probe = verify_in_fresh_interpreter(force, plan["gate"], plan["qualifying"])
        fault("after-probe")
        if probe.get("verdict") == "failed":
            raise InstallError("verify", "installed plugin failed its check: %s" % "; ".join(probe.get("reasons", [])))
        for path, digest in site_hashes.items():  # still what was written, before it is called ok
            check_written(path, digest)
        record = {
            "release": release_id,
            "python": sys.executable,
            "site_dir": site,
            "payload_dir": payload_dir,
            "payload_files": payload_files,
            "files": site_hashes,
            "dirs": [files["dist_info"], payload_dir],
            "forced": plan["forced"],
            "qualifying": plan["qualifying"],
            "qualified_by": plan["gate"].get("qualified_by"),
            "gate": plan["gate"],
            "probe": {"verdict": probe.get("verdict"), "reasons": probe.get("reasons")},
            "server_defaults": journal["server_defaults"],  # the variables written into the payload, or None
            "deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "previous": previous,  # what `rollback` puts back, byte for byte (None: it removes everything)
        }
        write_json(record_path, record)
        fault("after-record")
    except Exception as err:  # noqa: BLE001 - whatever failed, the previous deployment goes back
        if isinstance(err, InstallError):
            kind, message = err.kind, str(err)
        elif isinstance(err, OSError):
            kind, message = "os-error", os_error_line(err)
        else:
            kind, message = "internal", "%s: %s" % (type(err).__name__, err)
        _, clause = undo_install(site, journal, journal_path)
        raise InstallError(kind, "%s; removed again%s" % (message, clause))
    finish_commit(directory, record, old)
    action = "installed" if not old else "replaced" if old["release"] != release_id else \
        "reconfigured" if plan["action"].endswith("reconfigure") else "repaired"
    return {"ok": True, "action": action, "plan": plan, "probe": probe,
            "record": record_path, "recovered": recovered, "replaced": replaced,
            "rollback_restores": (previous or {}).get("release"),
            "server_defaults": sources.get("server_defaults")}


def verify_unchanged(record_path, record, plan, force, recovered):
    """The same release, intact: check it again, and record this deploy's gate and --force."""
    probe = verify_in_fresh_interpreter(force, plan["gate"], plan["qualifying"])
    if probe.get("verdict") == "failed":
        raise InstallError("verify", "release %s is deployed and intact but fails its check: %s" % (
            record["release"], "; ".join(probe.get("reasons", []))))
    record.update(forced=plan["forced"], qualifying=plan["qualifying"], qualified_by=plan["gate"].get("qualified_by"),
                  gate=plan["gate"],
                  probe={"verdict": probe.get("verdict"), "reasons": probe.get("reasons")},
                  verified_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_json(record_path, record)
    return {"ok": True, "action": "unchanged", "plan": plan, "probe": probe, "record": record_path,
            "recovered": recovered, "server_defaults": plan["server_defaults"]}


def op_rollback(workdir, lock_wait=None, force=False):
    return with_environment_lock(lock_wait, rollback_locked, workdir, force)


def rollback_locked(site, workdir, force=False):
    recovered = recover(workdir, site)
    directory = deployment_dir(workdir, site)
    # A rollback undoes exactly one step. A rollback killed half-way, finished just now, is the
    # rollback asked for; so is undoing a deploy killed before its record (the environment is
    # back as that deploy found it): neither goes on to roll back one more deployment.
    if recovered and recovered.get("rollback_of"):
        return {"ok": True, "action": "rolled-back", "interrupted": True, "release": recovered["rollback_of"],
                "restored": recovered["restored"], "release_defaults": recovered.get("release_defaults"),
                "restored_defaults": recovered.get("restored_defaults"), "removed": recovered,
                "recovered": recovered, "site_dir": site}
    if recovered and recovered.get("interrupted_deploy"):
        return {"ok": True, "action": "recovered", "interrupted": True, "release": recovered["interrupted_deploy"],
                "restored": recovered.get("restored"), "release_defaults": recovered.get("release_defaults"),
                "restored_defaults": recovered.get("restored_defaults"), "removed": recovered,
                "recovered": recovered, "site_dir": site}
    record_path = os.path.join(directory, "record.json")
    record = read_json(record_path)
    if record is None:
        record = unrecorded_deployment(workdir, site)
        if record is None:
            return {"ok": True, "action": "nothing-deployed" if recovered is None else "recovered",
                    "recovered": recovered, "site_dir": site}
    check_footprint(record, site, workdir, record_path)
    changed = changed_since_deploy(record)
    if changed and not force:
        raise InstallError("changed", "kept the deployment of release %s: %d file(s) changed since deploy: %s;"
                                      " `rollback --force` removes them too" % (
                                          record["release"], len(changed), "; ".join(changed)))
    previous = record.get("previous")
    unrestorable = restore_problems(site, previous)
    if unrestorable and not force:
        raise InstallError("changed", "kept the deployment of release %s: the release it replaced, %s, cannot be put"
                                      " back byte for byte: %s; `rollback --force` removes %s without putting %s back" % (
                                          record["release"], previous["release"], "; ".join(unrestorable),
                                          record["release"], previous["release"]))
    restoring = previous if previous and not unrestorable else None
    # forced past a previous payload that changed: it goes too, never run again
    dirs = list(record["dirs"]) + ([previous["payload_dir"]] if previous and not restoring else [])
    journal = {"op": "rollback", "release": record["release"], "started": time.time(),
               "files": record["files"], "dirs": dirs, "previous": restoring,
               "server_defaults": defaults_of(record)}
    make_own_dir(directory)  # as an install makes it: gone if deleted with the record (unrecorded_deployment)
    write_json(os.path.join(directory, "journal.json"), journal)
    fault("rollback-after-journal")
    removed = finish_rollback(site, directory, journal)
    removed["modified_since_deploy"] = changed
    removed.pop("rollback_of")
    return {"ok": True, "action": "rolled-back", "interrupted": False, "release": record["release"],
            "restored": removed.pop("restored"), "release_defaults": removed.pop("release_defaults"),
            "restored_defaults": removed.pop("restored_defaults"), "removed": removed, "recovered": recovered,
            "site_dir": site}


def finish_rollback(site, directory, journal):
    """Carry out (or, after a kill, finish) a rollback journal: remove what it lists, put its
    previous deployment back (site files from (release, payload dir), checked as written: the
    bytes they had; its record) or, with nothing to put back, drop the record; then the
    journal. Every step may be repeated, so a rollback killed anywhere finishes here."""
    removed = remove_recorded(journal)
    fault("rollback-after-remove")
    record_path = os.path.join(directory, "record.json")
    previous = journal.get("previous")
    if previous:
        write_site_files(site, previous["release"], previous["payload_dir"], planned_files(site, previous["release"]),
                         fault_point="rollback-after-pth")
        fault("rollback-after-site-files")
        write_json(record_path, previous)
    elif os.path.exists(record_path):
        os.unlink(record_path)
    fault("rollback-after-record")
    os.unlink(os.path.join(directory, "journal.json"))
    if not previous:
        try:
            os.rmdir(directory)
        except OSError:
            pass
    removed.update(rollback_of=journal["release"], restored=previous["release"] if previous else None,
                   release_defaults=journal.get("server_defaults"), restored_defaults=defaults_of(previous))
    return removed


def restore_problems(site, previous):
    """["why not"] for putting `previous` back byte for byte: its payload must be as recorded,
    and its site files must come out as the bytes its record holds."""
    if not previous:
        return []
    changed = changed_since_deploy({"files": {}, "dirs": [previous["payload_dir"]],
                                    "payload_dir": previous["payload_dir"],
                                    "payload_files": previous.get("payload_files")})
    if not os.path.isdir(previous["payload_dir"]) or os.path.islink(previous["payload_dir"]):
        changed.append("%s (gone)" % previous["payload_dir"])
    elif set(payload_hashes(previous["payload_dir"])) != set(previous.get("payload_files") or {}):
        changed.append("%s (files missing)" % previous["payload_dir"])
    contents = site_file_contents(site, previous["release"], previous["payload_dir"],
                                  planned_files(site, previous["release"]))
    hashes = dict((p, hashlib.sha256(d).hexdigest()) for p, d in contents.items())
    if hashes != previous.get("files"):
        changed.append("its site files would not match its record")
    return changed


def unrecorded_deployment(workdir, site):
    """No record here: a deployment this workdir made whose record was deleted is rolled back
    from its own dist-info RECORD; one from another workdir is refused with the way out."""
    found = unlisted_deployment(site, set(), set())
    if found is None or not ours_elsewhere(found):
        return None
    if found["workdir"] != workdir:
        raise InstallError("refused", "nothing deployed from %s; %s" % (workdir, ownership_refusal(found, workdir, site)))
    files = [found["pth"]] if found["pth"] else []
    for dist_info in found["dist_infos"]:
        for line in (read_text(os.path.join(dist_info, "RECORD")) or "").splitlines():
            path = os.path.normpath(os.path.join(site, line.split(",")[0]))
            if line.strip() and path.startswith(dist_info + os.sep):
                files.append(path)
    dirs = found["dist_infos"] + ([found["payload_dir"]] if found["payload_dir"] else [])
    # What deploy wrote is known without the record: the site files follow from (release,
    # payload dir), the payload is the release's src/ddtree (while the release is on the host).
    expected = {}
    if found["release"] and found["payload_dir"]:
        expected = site_file_contents(site, found["release"], found["payload_dir"],
                                      planned_files(site, found["release"]))
    hashes = {p: hashlib.sha256(expected[p]).hexdigest() if p in expected else "" for p in files}
    return {"release": found["release"], "files": hashes, "dirs": dirs, "payload_dir": found["payload_dir"],
            "payload_files": release_payload_hashes(workdir, found["release"])}


def op_deployed(workdir):
    """What deploy recorded for this environment, read only (`ddtree-ops status`): the release,
    when and how (forced, qualified), and the server defaults it wrote (`deploy --budget`);
    "record": None when nothing was deployed here by this workdir."""
    site = site_dir()
    record_path = os.path.join(deployment_dir(workdir, site), "record.json")
    record = read_json(record_path)
    if not record:
        return {"site_dir": site, "record": None}
    defaults = read_json(os.path.join(record["payload_dir"], DEFAULTS_FILE_NAME))
    return {"site_dir": site, "record": record_path, "release": record.get("release"),
            "deployed_at": record.get("deployed_at"), "forced": record.get("forced"),
            "qualifying": record.get("qualifying"), "qualified_by": record.get("qualified_by"),
            "evidence": (record.get("gate") or {}).get("verdict"),
            "server_defaults": (defaults or {}).get("variables")}


def release_payload_hashes(workdir, release_id):
    """{payload path: sha256} that a payload copied from the release has (copy_payload copies
    its src/ddtree), from the release's manifest; None when the release is not on the host."""
    if not release_id:
        return None
    manifest = read_text(os.path.join(workdir, "releases", release_id, "MANIFEST.sha256"))
    if manifest is None:
        return None
    hashes = {}
    for line in manifest.splitlines():
        digest, _, relpath = line.partition("  ")
        if relpath.startswith("src/ddtree/"):
            hashes[relpath[len("src/"):]] = digest
    return hashes


def main(argv):
    sys.dont_write_bytecode = True
    op, workdir, args = argv[0], os.path.abspath(os.path.expanduser(argv[1])), argv[2:]
    if op == "rollback":
        return op_rollback(workdir)
    line = sys.stdin.buffer.readline()
    sources = json.loads(line.decode("utf-8")) if line.strip() else {"modules": {}, "packages": []}
    if op == "plan":
        return op_plan(workdir, args[0], args[1], sources, args[2:3] == ["1"])
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
