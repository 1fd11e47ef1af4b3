"""The bytes of a host's pinned SGLang files, hashed on our side (`sglang qualify`).

A qualification entry vouches for files on every host that matches it, so its hashes must be
ones ddtree-ops computed itself, never numbers a host sent (a host's `plugin` stage metrics
are its word). The host's Python only reads the files the manifest pins and sends their bytes;
here they are laid out in a scratch folder and run through the gate's own file check
(ddtree.sglang.gate.check_files), the very function that judges them on a deploy.
"""
from __future__ import annotations

import base64
import binascii
import tempfile
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ddtree_ops.errors import RemoteStepError
from ddtree_ops.inventory import Host
from ddtree_ops.remote_layout import AGENT_REPLY_MAX_BYTES
from ddtree_ops.transport.base import Transport

if TYPE_CHECKING:  # pragma: no cover
    from ddtree.sglang.manifest import Manifest

# Runs in the host's Python: argv = package dir, then the pinned relative paths; prints
# {relpath: base64 bytes, or null when it cannot be read}. Reads only, follows no link.
_READER = """import base64, json, os, sys
root, out = sys.argv[1], {}
for rel in sys.argv[2:]:
    path = os.path.join(root, rel)
    try:
        if os.path.islink(path):
            raise OSError("a link")
        with open(path, "rb") as handle:
            out[rel] = base64.b64encode(handle.read()).decode("ascii")
    except OSError:
        out[rel] = None
print(json.dumps(out))
"""


def manifest_for(version: str | None) -> "Manifest | None":
    """The manifest the gate checks `version` against: its own, else the newest shipped."""
    from ddtree.sglang.manifests import SUPPORTED, newest

    return SUPPORTED.get(version or "") or newest(SUPPORTED)


def hash_pinned_files(transport: Transport, host: Host, package_dir: str,
                      manifest: "Manifest") -> tuple[dict[str, str], list[str]]:
    """({relpath: sha256} hashed here, ["file: why"] for pinned files the host lacks) for every
    file `manifest` pins, as it is under the host's `package_dir`. RemoteStepError naming the
    host for a reply that is not the files asked for."""
    from ddtree.sglang.gate import FindingKind, check_files

    wanted = sorted(manifest.file_sha256)
    result = transport.run([host.python, "-c", _READER, package_dir, *wanted], timeout=host.command_timeout,
                           max_output_bytes=AGENT_REPLY_MAX_BYTES)
    from ddtree.bounded_files import FileRefused, parse_json

    try:
        sent = parse_json((result.stdout.strip().splitlines() or [""])[-1], f"{host.name}: pinned files")
    except FileRefused:
        sent = None
    if result.exit_status != 0 or not isinstance(sent, dict) or sorted(sent) != wanted:
        raise RemoteStepError(f"{host.name}: could not read the pinned sglang files in {package_dir}: "
                              f"{result.tail() or 'not the files asked for'}")
    with tempfile.TemporaryDirectory(prefix="ddtree-pinned-") as scratch:
        for rel, data in sent.items():
            if data is None:
                continue  # check_files names it missing
            if not isinstance(data, str) or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
                raise RemoteStepError(f"{host.name}: pinned file {rel!r}: not a relative path with its bytes")
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise RemoteStepError(f"{host.name}: pinned file {rel!r}: its bytes are not base64") from None
            target = Path(scratch, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)
        findings, hashes = check_files(Path(scratch), manifest)
    missing = [f"{f.name}: {f.detail}" for f in findings if f.kind is FindingKind.MISSING_FILE]
    return hashes, missing
