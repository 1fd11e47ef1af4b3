"""The ddtree-ops host agent: one process per host per step, run by the host's own Python.

Stdlib only, Python >= 3.8. It arrives on stdin behind a small bootstrap (see
`ddtree_ops.remote_layout.BOOTSTRAP`); whatever follows it on stdin (a release archive) is
left for the operation to read. Usage: `python -c BOOTSTRAP OP WORKDIR [ARGS...]`.

Every operation prints exactly one JSON object as its last stdout line: `{"ok": true, ...}`
or `{"ok": false, "kind": ..., "error": ...}` (exit status 0 or 1); `collect`, whose stdout
is a tar stream, prints it as the last line of stderr instead. `deploy` and `rollback` run
the SGLang installer (sent on stdin) in this same process. Layout under WORKDIR:

    releases/<id>/          immutable release, repository-relative layout + MANIFEST.sha256
    releases/.incoming-*    a release being received (removed by the next push)
    current -> releases/<id>  switched atomically (symlink + rename)
    runs/<run-id>/          per-run result folders
    deployments/            records of what was deployed where
    lock                    flock()ed by whoever changes the layout
"""
import errno
import fcntl
import hashlib
import json
import os
import stat
import sys
import time

# platform, shutil, socket and tarfile are imported where they are used: every SSH session
# to every host starts this script, and a push that finds its release in place needs none.

MANIFEST_NAME = "MANIFEST.sha256"
RELEASE_ID_CHARS = 16
INCOMING_PREFIX = ".incoming-"
BROKEN_PREFIX = ".broken-"
CHUNK = 1 << 16


class AgentError(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


# ---------------------------------------------------------------- ids

SAFE_ID_FIRST = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
SAFE_ID_CHARS = SAFE_ID_FIRST + "._-"


def is_safe_id(value):
    """Release and run ids are path parts (here and on the operator side, ddtree_ops.ids): 1-128
    of [A-Za-z0-9._-], starting with a letter or digit (no re import, which costs start time)."""
    return isinstance(value, str) and 0 < len(value) <= 128 and value[0] in SAFE_ID_FIRST \
        and all(c in SAFE_ID_CHARS for c in value)


def check_id(value, what):
    if not is_safe_id(value):
        raise AgentError("bad-id", "unsafe %s %r" % (what, value[:64]))
    return value


# ---------------------------------------------------------------- layout helpers


def resolve_workdir(raw):
    return os.path.abspath(os.path.expanduser(raw))


def releases_dir(workdir):
    return os.path.join(workdir, "releases")


def active_release(workdir):
    """The id `current` points to, or None. Only a link we make counts (`releases/<id>`,
    relative): one aimed anywhere else, even at a folder named like a release, is not ours."""
    try:
        target = os.readlink(os.path.join(workdir, "current"))
    except OSError:
        return None
    head, sep, release_id = target.partition("/")
    if head != "releases" or not sep:
        return None
    try:
        return check_id(release_id, "release id")
    except AgentError:
        return None


# ---------------------------------------------------------------- whose paths these are


def describe_path(path, st=None):
    """'folder, owner alice, mode 0775' for a refusal (the owner by name where it has one)."""
    try:
        st = st or os.lstat(path)
    except OSError as err:
        return err.strerror or str(err)
    import pwd

    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = "uid %d" % st.st_uid
    kind = "symlink" if stat.S_ISLNK(st.st_mode) else "folder" if stat.S_ISDIR(st.st_mode) else "file"
    return "%s, owner %s, mode %04o" % (kind, owner, stat.S_IMODE(st.st_mode))


def unsafe_path(path, why, st=None):
    return AgentError("unsafe-path", "%s: %s (%s); ddtree-ops changes only what the login user alone"
                                     " controls" % (path, why, describe_path(path, st)))


def check_own_dir(path):
    """A folder of the layout: a real folder (never a link: we follow none we did not make),
    owned by the login user, writable by nobody else."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise unsafe_path(path, "is a symlink", st)
    if not stat.S_ISDIR(st.st_mode):
        raise unsafe_path(path, "is not a folder", st)
    if st.st_uid != os.geteuid():
        raise unsafe_path(path, "is owned by another account", st)
    if st.st_mode & 0o022:
        raise unsafe_path(path, "is writable by group or others", st)


def path_prefixes(path):
    """'/', '/a', '/a/b' for '/a/b'."""
    parts = [p for p in path.split("/") if p]
    return ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def check_ancestors(workdir):
    """Every folder above the workdir, as written and as resolved: owned by root or the login
    user, and writable by nobody else unless sticky (like /tmp, where others cannot rename
    what is ours). A symlink on the way must be root's or ours (its owner decides its target)."""
    trusted = (0, os.geteuid())
    parent = os.path.dirname(workdir)
    for prefix in dict.fromkeys(path_prefixes(parent) + path_prefixes(os.path.realpath(parent))):
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            continue  # made below, by us
        if st.st_uid not in trusted:
            raise unsafe_path(prefix, "is owned by another account", st)
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise unsafe_path(prefix, "is writable by group or others", st)


def make_own_dir(path):
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    check_own_dir(path)


def ensure_layout(workdir):
    """Create what is missing of the layout, and refuse one that another account could change."""
    check_ancestors(workdir)
    for prefix in path_prefixes(os.path.dirname(workdir)):
        if not os.path.lexists(prefix):
            os.mkdir(prefix, 0o755)
    make_own_dir(workdir)
    for sub in ("releases", "runs", "deployments"):
        make_own_dir(os.path.join(workdir, sub))


# ---------------------------------------------------------------- manifest


def manifest_id(manifest_bytes):
    return hashlib.sha256(manifest_bytes).hexdigest()[:RELEASE_ID_CHARS]


def safe_relpath(path):
    parts = path.split("/")
    if not path or path.startswith("/") or "\x00" in path or any(p in ("", ".", "..") for p in parts):
        raise AgentError("bad-manifest", "unsafe path in manifest: %r" % path)
    return path


def parse_manifest(manifest_bytes):
    """{relpath: sha256} from `<sha256>  <relpath>` lines."""
    entries = {}
    for line in manifest_bytes.decode("utf-8").split("\n"):  # names never hold one (release.py)
        if not line:
            continue
        digest, sep, path = line.partition("  ")
        if not sep or len(digest) != 64:
            raise AgentError("bad-manifest", "malformed manifest line: %r" % line)
        entries[safe_relpath(path)] = digest
    return entries


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory):
    """The bytes of a folder's manifest (never through a link), or an OSError."""
    fd = os.open(os.path.join(directory, MANIFEST_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def release_problems(directory, release_id=None, allow_missing=False):
    """Every reason the directory does not hold exactly its release, [] when it does: the one
    release check, used by the agent (push, prune, probe, deploy) and by the smoke runner and its
    `import` stage (ddtree_ops.hostside.release_check). Bytecode caches are allowed (the runner
    compiles the release from its sources); a link anywhere is a problem: os.walk would not
    look inside a linked folder, and it could stand in for any module (even torch: the release
    comes first on the runner's sys.path). `release_id`: the id the manifest must hash to.
    `allow_missing`: files of the manifest may be gone (what prune asks: is all that is left
    ours, unedited?)."""
    try:
        manifest_bytes = read_manifest(directory)
    except OSError as err:
        return ["no readable manifest (%s)" % err.strerror]
    if release_id is not None and manifest_id(manifest_bytes) != release_id:
        return ["manifest does not hash to the release id"]
    try:
        entries = parse_manifest(manifest_bytes)
    except (AgentError, UnicodeDecodeError) as err:
        return [str(err)]
    problems = []
    for relpath, digest in entries.items():
        path = os.path.join(directory, relpath)
        if os.path.islink(path) or not os.path.isfile(path):
            if not (allow_missing and not os.path.lexists(path)):
                problems.append("missing file %s" % relpath)
            continue
        try:
            if file_sha256(path) != digest:
                problems.append("hash mismatch in %s" % relpath)
        except OSError as err:
            problems.append("unreadable file %s (%s)" % (relpath, err.strerror))
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                problems.append("unexpected link %s" % os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/"))
        in_cache = os.path.basename(root) == "__pycache__"
        for name in files:
            relpath = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if relpath != MANIFEST_NAME and relpath not in entries and not (in_cache and name.endswith(".pyc")) \
                    and not os.path.islink(os.path.join(root, name)):
                problems.append("unexpected file %s" % relpath)
        if in_cache and dirs:
            problems.append("unexpected folder %s" % os.path.relpath(os.path.join(root, dirs[0]), directory).replace(os.sep, "/"))
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
    return problems


def verify_release(directory, release_id, allow_missing=False):
    """None when the directory holds exactly the release, else the first reason it does not."""
    problems = release_problems(directory, release_id, allow_missing)
    return problems[0] if problems else None


HEX_DIGITS = "0123456789abcdef"


def is_release_id(name):
    """What manifest_id makes: RELEASE_ID_CHARS lowercase hex digits."""
    return len(name) == RELEASE_ID_CHARS and all(c in HEX_DIGITS for c in name)


def not_ours(directory, name):
    """None when releases/NAME bears this tool's mark (a real folder of the login user whose
    manifest hashes to its name), else why it is someone else's. Cheap: hashes one file."""
    if not is_release_id(name):
        return "not a release name"
    try:
        st = os.lstat(directory)
    except OSError as err:
        return err.strerror
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.geteuid():
        return "owned by another account"
    try:
        if manifest_id(read_manifest(directory)) != name:
            return "its %s does not hash to its name" % MANIFEST_NAME
    except OSError as err:
        return "no %s (%s)" % (MANIFEST_NAME, err.strerror)
    return None


def leftover_id(name):
    """The release id of `.incoming-<id>-<pid>` / `.broken-<id>-<pid>` (the names push gives
    a release being received or set aside), else None."""
    for prefix in (INCOMING_PREFIX, BROKEN_PREFIX):
        if name.startswith(prefix):
            release_id, sep, pid = name[len(prefix):].partition("-")
            if sep and is_release_id(release_id) and pid.isdigit():
                return release_id
    return None


# ---------------------------------------------------------------- lock


def open_own_file(path):
    """Open (creating it if absent) a file of the layout that is written in place (the lock):
    never through a link, and only a plain file of the login user's that no one else can
    write and that has no other name (a hard link to a file elsewhere would be truncated)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise unsafe_path(path, "is a symlink")
        raise
    st = os.fstat(fd)
    why = ("is not a plain file" if not stat.S_ISREG(st.st_mode)
           else "is owned by another account" if st.st_uid != os.geteuid()
           else "is writable by group or others" if st.st_mode & 0o022
           else "has another name (a hard link)" if st.st_nlink != 1 else None)
    if why is not None:
        os.close(fd)
        raise unsafe_path(path, why, st)
    return fd


class Lock(object):
    """An flock() on WORKDIR/lock: released by the kernel if this process dies."""

    def __init__(self, workdir, owner, wait_s):
        self.path = os.path.join(workdir, "lock")
        self.owner = owner
        self.wait_s = float(wait_s)
        self.fd = None

    def __enter__(self):
        self.fd = open_own_file(self.path)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    holder = os.pread(self.fd, 4096, 0).decode("utf-8", "replace").strip()
                    os.close(self.fd)
                    raise AgentError(
                        "locked",
                        "%s is held by %s (waited %gs)" % (self.path, holder or "another process", self.wait_s),
                    )
                time.sleep(0.1)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, ("%s pid=%d since=%s\n" % (self.owner, os.getpid(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))).encode(), 0)
        return self

    def __exit__(self, *exc):
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # closing drops the flock


class NoLock(object):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def maybe_lock(workdir, take_lock, owner, wait_s):
    return Lock(workdir, owner, wait_s) if take_lock == "1" else NoLock()


# ---------------------------------------------------------------- release operations


def remove_tree(path):
    import shutil

    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        try:
            os.unlink(path)  # rmtree leaves a file (or a link) where a folder was expected
        except OSError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


def is_real_dir(path):
    return os.path.isdir(path) and not os.path.islink(path)


def clean_incoming(workdir):
    """Leftovers of killed pushes (our names, real folders of ours); safe because the caller
    holds the lock. Anything else is left to prune, which names it."""
    base = releases_dir(workdir)
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if leftover_id(name) is not None and is_real_dir(path) and os.lstat(path).st_uid == os.geteuid():
            remove_tree(path)


def set_current(workdir, release_id):
    """Point `current` at releases/<id> atomically: a new symlink renamed over the old one."""
    current = os.path.join(workdir, "current")
    if os.path.lexists(current) and not os.path.islink(current):
        # never ours (we only ever make a link): the operator's data, so say so and stop
        raise AgentError("layout", "%s: not a symlink made by ddtree-ops; move it out of the way" % current)
    if os.path.islink(current) and not is_release_id(os.path.basename(os.readlink(current).rstrip("/"))):
        # an application's own `current` (releases/20240101120000, ...): not ours to switch
        raise AgentError("layout", "%s -> %s: not a symlink made by ddtree-ops; move it out of the way"
                                   % (current, os.readlink(current)))
    tmp = os.path.join(workdir, ".current.tmp-%d" % os.getpid())
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", release_id), tmp)
    os.replace(tmp, current)
    now = time.time()
    os.utime(os.path.join(releases_dir(workdir), release_id), (now, now))
    fsync_dir(workdir)


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(workdir, keep):
    """Keep the `keep` most recently activated releases; never the active one. Only releases
    this tool installed count and are removed: a folder whose manifest hashes to its name
    and that holds nothing else (no file added, none edited; bytecode caches aside).
    Returns (pruned ids, ["NAME: why it was left"] for everything else found there)."""
    doomed, foreign = prune_plan(workdir, keep, active_release(workdir))
    for name in doomed:
        remove_tree(os.path.join(releases_dir(workdir), name))
    return doomed, foreign


def prune_plan(workdir, keep, active, arriving=None):
    """What `prune` would remove and leave, removing nothing: (ids, ["NAME: why it was left"]).
    `arriving`: a release not there yet that would be the newest (a push's dry run)."""
    base = releases_dir(workdir)
    ours, foreign = ([arriving] if arriving else []), []
    for name in sorted(os.listdir(base)):
        if name == arriving:
            continue  # a damaged copy the push replaces
        if leftover_id(name) is not None and is_real_dir(os.path.join(base, name)):
            continue  # a push in flight elsewhere cannot hold the lock: clean_incoming's
        why = not_ours(os.path.join(base, name), name)
        if why is None:
            ours.append(name)
        else:
            foreign.append("%s: %s" % (name, why))
    ours.sort(key=lambda n: float("inf") if n == arriving else os.lstat(os.path.join(base, n)).st_mtime,
              reverse=True)
    kept = [n for n in ours if n == active][:1]
    for name in ours:
        if name != active and len(kept) < max(int(keep), 1):
            kept.append(name)
    doomed = []
    for name in ours:
        if name in kept:
            continue
        why = verify_release(os.path.join(base, name), name, allow_missing=True)
        if why is None:
            doomed.append(name)
        else:
            foreign.append("%s: %s since push" % (name, why))
    return doomed, sorted(foreign)


def set_aside_broken(workdir, release_id):
    base = releases_dir(workdir)
    aside = os.path.join(base, "%s%s-%d" % (BROKEN_PREFIX, release_id, os.getpid()))
    os.rename(os.path.join(base, release_id), aside)
    remove_tree(aside)


def activate_if_present(workdir, release_id, keep):
    """(reply, None) when an intact copy is here (now active); else (None, why a copy was
    rejected or None). Caller holds the lock."""
    clean_incoming(workdir)
    directory = os.path.join(releases_dir(workdir), release_id)
    if not os.path.lexists(directory):
        return None, None
    problem = damaged_copy(directory, release_id)
    if problem is not None:
        return None, problem
    previous = active_release(workdir)
    if previous != release_id:
        set_current(workdir, release_id)
    return with_pruned({"status": "unchanged" if previous == release_id else "activated",
                        "previous": previous, "workdir": workdir}, workdir, keep), None


def refuse_foreign(directory, why):
    raise AgentError("foreign", "%s: %s, so not a release ddtree-ops installed; push leaves it:"
                                " move it out of the way" % (directory, why))


def damaged_copy(directory, release_id):
    """None when releases/<id> is an intact copy. A damaged copy of ours is set aside and
    removed (why is returned); a link there is removed (only the link); anything else there
    was not made by this tool: refused, untouched."""
    if os.path.islink(directory):
        os.unlink(directory)
        return "%s: not a folder" % directory
    why = not_ours(directory, release_id)
    if why is not None:
        refuse_foreign(directory, why)
    problem = verify_release(directory, release_id)
    if problem is not None:
        set_aside_broken(os.path.dirname(os.path.dirname(directory)), release_id)  # never activated
    return problem


def with_pruned(reply, workdir, keep):
    reply["pruned"], reply["foreign"] = prune(workdir, keep)
    return reply


def op_push(workdir, release_id, keep, lock_wait, take_lock):
    """Activate an intact copy if present, else install, in one process and one channel: when
    the release is missing, print `{"need": ID}` and read the archive that the operator side
    then sends on stdin."""
    check_id(release_id, "release id")
    ensure_layout(workdir)
    with maybe_lock(workdir, take_lock, "push", lock_wait):
        return push_locked(workdir, release_id, keep)


def push_locked(workdir, release_id, keep):
    """The body of push; the caller holds the lock."""
    reply, problem = activate_if_present(workdir, release_id, keep)
    if reply is not None:
        return reply
    sys.stdout.write(json.dumps({"need": release_id}) + "\n")
    sys.stdout.flush()
    reply = install_from_stdin(workdir, release_id, keep)
    reply["replaced_broken"] = problem
    return reply


def create_new(path, mode=0o644):
    """A file opened for writing that did not exist (no link followed, nothing truncated)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return NamedWriter(path, os.fdopen(fd, "wb"))


class NamedWriter:
    """A file being written whose errors name it: a write or close that fails on a full disk
    carries no file name of its own (`push: : No space left on device`)."""

    def __init__(self, path, handle):
        self.path, self.handle = path, handle

    def write(self, data):
        try:
            return self.handle.write(data)
        except OSError as err:
            raise named(err, self.path) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.handle.close()  # flushes: the last buffered bytes may meet the full disk here
        except OSError as err:
            if exc[0] is None:
                raise named(err, self.path) from None


def named(err, path):
    """`err` naming `path` when it names no file itself."""
    if err.filename is not None:
        return err
    return type(err)(err.errno, err.strerror or str(err), path)


def receive_archive(stream, target, release_id):
    """Unpack a tar stream whose first member is the manifest; check every file on the way."""
    import tarfile

    entries = None
    seen = set()
    with tarfile.open(fileobj=stream, mode="r|*") as archive:
        for member in archive:
            if not member.isfile():
                raise AgentError("bad-archive", "archive member %r is not a regular file" % member.name)
            data = archive.extractfile(member)
            if entries is None:
                if member.name != MANIFEST_NAME:
                    raise AgentError("bad-archive", "archive does not start with %s" % MANIFEST_NAME)
                manifest_bytes = data.read()
                if manifest_id(manifest_bytes) != release_id:
                    raise AgentError("bad-archive", "manifest does not hash to release %s" % release_id)
                entries = parse_manifest(manifest_bytes)
                with create_new(os.path.join(target, MANIFEST_NAME)) as out:
                    out.write(manifest_bytes)
                continue
            relpath = member.name
            if relpath not in entries:
                raise AgentError("bad-archive", "archive holds %r, which is not in the manifest" % relpath)
            path = os.path.join(target, relpath)
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            digest = hashlib.sha256()
            with create_new(path) as out:
                for chunk in iter(lambda: data.read(CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
            os.chmod(path, 0o755 if member.mode & 0o111 else 0o644)
            if digest.hexdigest() != entries[relpath]:
                raise AgentError("hash-mismatch", "%s arrived with the wrong sha256" % relpath)
            seen.add(relpath)
    if entries is None:
        raise AgentError("bad-archive", "empty archive")
    missing = sorted(set(entries) - seen)
    if missing:
        raise AgentError("bad-archive", "archive lacks %d file(s), first %s" % (len(missing), missing[0]))


def op_install(workdir, release_id, keep, lock_wait, take_lock):
    """Receive the release on stdin, verify it, rename it into place, switch `current`."""
    check_id(release_id, "release id")
    ensure_layout(workdir)
    with maybe_lock(workdir, take_lock, "push", lock_wait):
        clean_incoming(workdir)
        return install_from_stdin(workdir, release_id, keep)


def install_from_stdin(workdir, release_id, keep):
    """Caller holds the lock."""
    base = releases_dir(workdir)
    incoming = os.path.join(base, "%s%s-%d" % (INCOMING_PREFIX, release_id, os.getpid()))
    os.mkdir(incoming, 0o755)
    try:
        # Checks every file's sha256 as it is written and that none is missing or extra, so
        # the fresh directory needs no second pass.
        receive_archive(sys.stdin.buffer, incoming, release_id)
        final = os.path.join(base, release_id)
        if os.path.lexists(final) and damaged_copy(final, release_id) is None:
            remove_tree(incoming)  # someone else already installed it intact
            incoming = None
        if incoming is not None:
            os.rename(incoming, final)
            fsync_dir(base)
    except BaseException:
        if incoming is not None:
            remove_tree(incoming)
        raise
    previous = active_release(workdir)
    set_current(workdir, release_id)
    return with_pruned({"status": "uploaded", "previous": previous, "workdir": workdir}, workdir, keep)


def op_hold_lock(workdir, owner, lock_wait):
    """Hold the layout lock until stdin reaches EOF (the operator side closed it or died)."""
    ensure_layout(workdir)
    with Lock(workdir, owner, lock_wait):
        sys.stdout.write("locked\n")
        sys.stdout.flush()
        while sys.stdin.buffer.read(CHUNK):
            pass
    return {"status": "released", "workdir": workdir}


def op_plan_push(workdir, release_id, keep):
    """What `push` would do here, touching nothing (no folder made, no lock, nothing removed):
    upload / activate / unchanged, the damaged copy it would replace, what it would prune."""
    check_id(release_id, "release id")
    directory = os.path.join(releases_dir(workdir), release_id)
    problem = None
    if os.path.islink(directory):
        problem = "%s: not a folder" % directory
    elif os.path.lexists(directory):
        why = not_ours(directory, release_id)
        if why is not None:
            refuse_foreign(directory, why)  # as push would
        problem = verify_release(directory, release_id)
    present = os.path.lexists(directory) and problem is None
    previous = active_release(workdir)
    status = ("unchanged" if previous == release_id else "activate") if present else "upload"
    pruned, foreign = ([], [])
    if os.path.isdir(releases_dir(workdir)):
        pruned, foreign = prune_plan(workdir, keep, release_id, arriving=None if present else release_id)
    return {"status": status, "previous": previous, "workdir": workdir, "replaces_broken": problem,
            "pruned": pruned, "foreign": foreign}


def op_whereis(workdir):
    return {"workdir": workdir, "active_release": active_release(workdir), "home": os.path.expanduser("~")}


# ---------------------------------------------------------------- probe (hosts check)


def os_name():
    try:
        with open("/etc/os-release") as handle:
            for line in handle:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    import platform

    return platform.system()


def enable_site_packages():
    """The agent runs with `python -S` (fast start); facts about installed packages need them."""
    if sys.flags.no_site:
        import site

        site.main()


def nvidia_gpus():
    """GPU names and memory from nvidia-smi (no CUDA context, no torch import)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=20, check=True,
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for index, line in enumerate(l for l in out.splitlines() if l.strip()):
        name, _, mib = line.rpartition(",")
        try:
            gpus.append({"index": index, "name": name.strip(), "memory_gib": round(float(mib) / 1024, 1)})
        except ValueError:
            continue
    return gpus


def torch_facts_static():
    """torch version and CUDA build from its files, GPUs from nvidia-smi: no torch import."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except Exception as err:  # noqa: BLE001
        return {"installed": False, "error": "%s: %s" % (type(err).__name__, err)}
    if spec is None:
        return {"installed": False, "error": "ModuleNotFoundError: No module named 'torch'"}
    facts = {"installed": True, "version": "?", "cuda_build": None, "imported": False}
    version_file = os.path.join(os.path.dirname(spec.origin or ""), "version.py")
    try:
        with open(version_file) as handle:
            for line in handle:
                key, _, value = line.partition("=")
                key, value = key.strip().split(":")[0].strip(), value.strip().strip("'\"")
                if key == "__version__":
                    facts["version"] = value
                elif key == "cuda" and value != "None":
                    facts["cuda_build"] = value
    except OSError:
        pass
    gpus = nvidia_gpus()
    facts["gpus"] = gpus or []
    facts["cuda_available"] = bool(facts["cuda_build"] and gpus)
    if gpus is None:
        facts["gpu_note"] = "nvidia-smi not found"
    return facts


def torch_facts():
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - any import failure is a fact to report
        return {"installed": False, "error": "%s: %s" % (type(err).__name__, err)}
    facts = {"installed": True, "imported": True, "version": getattr(torch, "__version__", "?"),
             "cuda_build": getattr(torch.version, "cuda", None), "cuda_available": False, "gpus": []}
    try:
        facts["cuda_available"] = bool(torch.cuda.is_available())
        if facts["cuda_available"]:
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                facts["gpus"].append({"index": index, "name": props.name,
                                      "memory_gib": round(props.total_memory / 2 ** 30, 1)})
    except Exception as err:  # noqa: BLE001
        facts["cuda_error"] = "%s: %s" % (type(err).__name__, err)
    return facts


def sglang_facts():
    """Version and install path without running sglang's (heavy) package __init__, and the
    SGLANG_PLUGINS allow-list SGLang's processes started from this environment would see."""
    import importlib.util

    plugins = os.environ.get("SGLANG_PLUGINS")
    try:
        spec = importlib.util.find_spec("sglang")
    except Exception as err:  # noqa: BLE001
        return {"installed": False, "error": str(err), "plugins_env": plugins}
    if spec is None:
        return {"installed": False, "plugins_env": plugins}
    version = None
    try:
        from importlib import metadata

        version = metadata.version("sglang")
    except Exception:  # noqa: BLE001 - present on sys.path but without dist metadata
        pass
    locations = list(spec.submodule_search_locations or [])
    return {"installed": True, "version": version, "path": locations[0] if locations else spec.origin,
            "plugins_env": plugins}


def free_disk(workdir):
    probe = workdir
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    import shutil

    usage = shutil.disk_usage(probe)
    return {"path": probe, "free_gib": round(usage.free / 2 ** 30, 2)}


def op_probe(workdir, deep="0"):
    """deep=1 imports torch and asks torch.cuda (seconds); otherwise static facts only."""
    import platform
    import socket

    enable_site_packages()
    return {
        "hostname": socket.gethostname(),
        "os": os_name(),
        "kernel": platform.release(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": torch_facts() if deep == "1" else torch_facts_static(),
        "sglang": sglang_facts(),
        "disk": free_disk(workdir),
        "workdir": workdir,
        "active_release": active_release(workdir),
        "release_problem": release_problem(workdir),
    }


def release_problem(workdir):
    """Why the active release cannot be trusted (the same check push makes), or None; also
    None when there is no `current` at all."""
    current = os.path.join(workdir, "current")
    release_id = active_release(workdir)
    if release_id is None:
        if not os.path.lexists(current):
            return None
        try:
            return "current -> %s: not a release push made here" % os.readlink(current)
        except OSError:
            return "current is not a link push made"
    directory = os.path.join(releases_dir(workdir), release_id)
    if not is_real_dir(directory):
        return "releases/%s is missing" % release_id
    return verify_release(directory, release_id)


# ---------------------------------------------------------------- deploy / rollback (SGLang plugin)


def load_installer(stream):
    """The SGLang installer (ddtree_ops/hostside/sglang_install.py of the release being deployed),
    sent length-prefixed on stdin, then its JSON line of gate modules (absent for rollback).
    Run in this process, so a deploy starts the host's Python once (plus the installer's
    own check in a fresh interpreter, which must be fresh: it loads the plugin as SGLang would)."""
    import types

    size = int(stream.readline())
    module = types.ModuleType("ddtree_sglang_installer")
    module.__file__ = "<ddtree-sglang-installer>"
    exec(compile(stream.read(size), module.__file__, "exec"), module.__dict__)
    line = stream.readline()
    sources = json.loads(line.decode("utf-8")) if line.strip() else {"modules": {}, "packages": []}
    return module, sources


def call_installer(installer, operation, *args, **options):
    try:
        return operation(*args, **options)
    except installer.InstallError as err:
        raise AgentError(err.kind, str(err))
    except AgentError:
        raise
    except Exception as err:  # noqa: BLE001 - one JSON reply, whatever the installer hit
        raise AgentError("internal", "installer: %s: %s" % (type(err).__name__, err))


def op_deploy(workdir, release_id, keep, lock_wait, force, allow_shared_env="0"):
    """Under the layout lock: make the release active (asking for the archive only if the
    host lacks an intact copy), then gate + install + verify with the installer."""
    check_id(release_id, "release id")
    sys.dont_write_bytecode = True  # leave no bytecode in site-packages or the payload
    installer, sources = load_installer(sys.stdin.buffer)
    ensure_layout(workdir)
    started = time.monotonic()
    with Lock(workdir, "deploy", lock_wait):
        enable_site_packages()  # the .pth files as they are once the lock is ours (the installer rereads ours)
        # The installer also locks the environment (other workdirs may deploy into it): it
        # waits what this lock's wait left over.
        env_wait = remaining_wait(lock_wait, started)
        pushed = push_locked(workdir, release_id, keep)
        installed = call_installer(installer, installer.op_install,
                                   *with_env_wait(installer.op_install, (workdir, release_id, force, sources), env_wait),
                                   **accepted_options(installer.op_install, allow_shared_env=allow_shared_env == "1"))
    return {"push": pushed, "install": installed}


def remaining_wait(lock_wait, started):
    return max(1.0, float(lock_wait) - (time.monotonic() - started))


def with_env_wait(operation, args, wait):
    """args plus the environment lock's wait, for an installer that takes it: the installer
    comes from the release being deployed, which may predate that lock (an older checkout
    deployed to go back to it)."""
    import inspect

    try:
        takes_wait = len(inspect.signature(operation).parameters) > len(args)
    except (TypeError, ValueError):
        takes_wait = False
    return tuple(args) + (wait,) if takes_wait else tuple(args)


def accepted_options(operation, **options):
    """The options an installer operation takes (one from an older release may lack some)."""
    import inspect

    try:
        params = inspect.signature(operation).parameters
    except (TypeError, ValueError):
        return {}
    return dict((k, v) for k, v in options.items() if k in params)


def op_rollback(workdir, lock_wait, force="0"):
    sys.dont_write_bytecode = True
    installer, _ = load_installer(sys.stdin.buffer)
    ensure_layout(workdir)
    started = time.monotonic()
    with Lock(workdir, "rollback", lock_wait):
        enable_site_packages()
        args = with_env_wait(installer.op_rollback, (workdir,), remaining_wait(lock_wait, started))
        options = accepted_options(installer.op_rollback, force=force == "1")
        return {"rollback": call_installer(installer, installer.op_rollback, *args, **options)}


# ---------------------------------------------------------------- server status (ddtree-ops status)

METRICS_MAX_BYTES = 8 << 20  # SGLang's /metrics is a few hundred kB; past this it is not SGLang's


def op_server_status(workdir, port, timeout_s="10"):
    """What `ddtree-ops status` shows of a host, in one process of its Python: the SGLang
    installed there, what `deploy` recorded in the environment (the installer, sent on stdin,
    knows where), and the serving SGLang's /metrics, read on this host's loopback (no port is
    opened to the operator). The JSON line after the installer may name the metric families
    wanted ({"metric_prefixes": [...]}): only their lines travel back."""
    sys.dont_write_bytecode = True
    enable_site_packages()
    installer, sources = load_installer(sys.stdin.buffer)
    return {"sglang": sglang_facts(),
            "deployed": call_installer(installer, installer.op_deployed, workdir),
            "server": local_metrics(int(port), float(timeout_s), tuple(sources.get("metric_prefixes") or ()))}


def metric_name(line):
    """The family or sample name a line of the text format is about ('' for other lines)."""
    if line.startswith("# HELP ") or line.startswith("# TYPE "):
        return line[7:].split(" ", 1)[0]
    if line.startswith("#"):
        return ""
    return line.split("{", 1)[0].split(" ", 1)[0]


def local_metrics(port, timeout_s, prefixes=()):
    """{"state": running | not-running | no-metrics | error, "port", "metrics" (text) or "error"}."""
    import urllib.error
    import urllib.request

    url = "http://127.0.0.1:%d/metrics" % port
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    try:
        with direct.open(url, timeout=timeout_s) as reply:
            body = reply.read(METRICS_MAX_BYTES + 1)
    except urllib.error.HTTPError as err:
        state = "no-metrics" if err.code == 404 else "error"
        return {"state": state, "port": port, "error": "HTTP %d from %s" % (err.code, url)}
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        state = "not-running" if isinstance(reason, ConnectionRefusedError) else "error"
        return {"state": state, "port": port, "error": "%s: %s" % (url, reason)}
    if len(body) > METRICS_MAX_BYTES:
        return {"state": "error", "port": port, "error": "%s: more than %d bytes" % (url, METRICS_MAX_BYTES)}
    lines = body.decode("utf-8", "replace").splitlines()
    if prefixes:
        lines = [line for line in lines if metric_name(line).startswith(prefixes)]
    return {"state": "running", "port": port, "metrics": "\n".join(lines) + "\n"}


# ---------------------------------------------------------------- collect (a run's files)

SHA256_PAX_KEY = "DDTREE.sha256"
RUNNER_PID_FILE = "runner.pid"  # runner.py's PID_FILE: live state, not a result


class ExactReader(object):
    """Reads exactly `size` bytes of a file, zero-padded if it shrank meanwhile, so the tar
    stream stays well-formed; the operator side then sees the sha256 differ."""

    def __init__(self, handle, size):
        self.handle, self.left = handle, size

    def read(self, n=-1):
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.handle.read(n)
        data += b"\0" * (n - len(data))
        self.left -= n
        return data


def run_files(run_dir, skipped):
    """(relpath, path) of each regular file of a run; links are listed in `skipped`, never followed."""
    for root, dirs, files in os.walk(run_dir):
        dirs.sort()
        for name in list(dirs):
            if os.path.islink(os.path.join(root, name)):
                dirs.remove(name)
                skipped.append(os.path.relpath(os.path.join(root, name), run_dir))
        for name in sorted(files):
            path = os.path.join(root, name)
            relpath = os.path.relpath(path, run_dir).replace(os.sep, "/")
            if name.startswith(".") or name == RUNNER_PID_FILE:
                continue
            if os.path.islink(path) or not os.path.isfile(path):
                skipped.append(relpath)
                continue
            yield relpath, path


def op_collect(workdir, run_id):
    """Stream, as one tar on stdout, every file of runs/RUN_ID that the operator does not
    already hold. Stdin: one JSON line {relpath: [size, sha256]} of what it holds. Each
    member carries its sha256 (pax header); the reply goes to stderr (see STREAMING_OPS)."""
    check_id(run_id, "run id")
    run_dir = os.path.join(workdir, "runs", run_id)
    if not os.path.isdir(run_dir):
        raise AgentError("no-run", "no run %s under %s" % (run_id, os.path.dirname(run_dir)))
    line = sys.stdin.buffer.readline()
    held = json.loads(line.decode("utf-8")) if line.strip() else {}
    import tarfile

    sent, kept, skipped = 0, 0, []
    out = sys.stdout.buffer
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for relpath, path in run_files(run_dir, skipped):
            try:
                handle = open(path, "rb")
            except OSError:
                skipped.append(relpath)
                continue
            with handle:
                stat = os.fstat(handle.fileno())
                digest = hashlib.sha256()
                for chunk in iter(lambda: handle.read(min(CHUNK, stat.st_size - handle.tell())), b""):
                    digest.update(chunk)
                size = handle.tell()  # shorter than st_size if the file shrank meanwhile
                if held.get(relpath) == [size, digest.hexdigest()]:
                    kept += 1
                    continue
                handle.seek(0)
                info = tarfile.TarInfo(relpath)
                info.size, info.mode, info.mtime = size, 0o644, int(stat.st_mtime)
                info.pax_headers = {SHA256_PAX_KEY: digest.hexdigest()}
                archive.addfile(info, ExactReader(handle, size))
                sent += 1
    out.flush()
    return {"sent": sent, "kept": kept, "skipped": skipped, "run_dir": run_dir}


# ---------------------------------------------------------------- entry point

OPERATIONS = {
    "push": op_push,
    "plan-push": op_plan_push,
    "install": op_install,
    "hold-lock": op_hold_lock,
    "whereis": op_whereis,
    "probe": op_probe,
    "deploy": op_deploy,
    "rollback": op_rollback,
    "collect": op_collect,
    "server-status": op_server_status,
}
STREAMING_OPS = ("collect",)  # stdout carries data: the JSON reply goes to stderr instead


def main(argv):
    if len(argv) < 2 or argv[0] not in OPERATIONS:
        raise AgentError("usage", "usage: agent {%s} WORKDIR [ARGS...]" % ",".join(sorted(OPERATIONS)))
    op, workdir, args = argv[0], resolve_workdir(argv[1]), argv[2:]
    return OPERATIONS[op](workdir, *args)


def run(argv):
    reply_stream = sys.stderr if argv and argv[0] in STREAMING_OPS else sys.stdout
    try:
        reply = main(argv)
        reply["ok"] = True
        code = 0
    except AgentError as err:
        reply, code = {"ok": False, "kind": err.kind, "error": str(err)}, 1
    except OSError as err:
        where = "%s: " % err.filename if err.filename is not None else ""
        reply, code = {"ok": False, "kind": "os-error", "error": "%s%s" % (where, err.strerror or err)}, 1
    reply_stream.write("\n" + json.dumps(reply) + "\n")
    reply_stream.flush()
    return code


if __name__ == "__main__":
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # every file is closed by now: skip the interpreter's teardown
