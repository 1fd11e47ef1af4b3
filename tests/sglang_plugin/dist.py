"""The real sglang wheels (0.5.23, and the older 0.5.22 for upgrade tests), unpacked with
`pip install --no-deps --target` and cached.

The wheel is cached under <repo>/.cache/wheels (gitignored); a fresh clone downloads it
once from PyPI through pip. The 0.5.23 wheel is cp311/manylinux only; the files we read are
pure Python, so pip is told the target platform and never builds anything.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

SGLANG_VERSION = "0.5.23"  # the version the plugin is built against
PREVIOUS_SGLANG_VERSION = "0.5.22"  # a real release before it: a true upgrade
REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DDTREE_TEST_CACHE", REPO / ".cache"))
WHEELS = CACHE / "wheels"
_PLATFORM = ["--only-binary=:all:", "--platform", "manylinux_2_34_x86_64"]
_TARGET_PYTHON = "3.11"  # the unpacked tree the unit tests read (same .py files in every wheel)


@contextmanager
def _locked(name: str):
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-800:]}")


def sglang_wheel(python_version: str = _TARGET_PYTHON, version: str = SGLANG_VERSION) -> Path:
    """Path of the cached sglang-`version` wheel for CPython `python_version` (pip download if missing)."""
    tag = "cp" + python_version.replace(".", "")
    with _locked("sglang-wheel"):
        found = sorted(WHEELS.glob(f"sglang-{version}-{tag}-*.whl"))
        if not found:
            WHEELS.mkdir(parents=True, exist_ok=True)
            _pip("download", "--no-deps", *_PLATFORM, "--python-version", python_version, "-d", str(WHEELS),
                 f"sglang=={version}")
            found = sorted(WHEELS.glob(f"sglang-{version}-{tag}-*.whl"))
        return found[0]


def sglang_site(version: str = SGLANG_VERSION) -> Path:
    """A directory holding `sglang/` and its dist-info, as `pip install --no-deps` left them."""
    wheel = sglang_wheel(version=version)
    target = CACHE / f"sglang-{version}-target"
    with _locked("sglang-target"):
        marker = target / ".complete"
        if not marker.exists():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _pip("install", "--no-deps", "--no-index", *_PLATFORM, "--python-version", _TARGET_PYTHON,
                 "--target", str(partial), str(wheel))
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
            marker.touch()
    return target


def sglang_package_dir(version: str = SGLANG_VERSION) -> Path:
    return sglang_site(version) / "sglang"


def copy_gate_files(dest_site: Path, version: str = SGLANG_VERSION) -> Path:
    """A minimal copy of the installation the gate reads (pinned + named files, the files
    the worker's structural facts read, dist-info), for tests that tamper with it. Returns
    the copied `sglang` package dir."""
    from ddtree.sglang.manifests import SUPPORTED, newest
    from ddtree.sglang.structure import check_worker, worker_source

    source_site = sglang_site(version)
    manifest = newest(SUPPORTED)
    facts = check_worker(source_site / "sglang", worker_source())
    rel_files = set(manifest.file_sha256) | {r.file for r in manifest.names} | {"_version.py"} | facts.files_read
    for rel in rel_files:
        if not (source_site / "sglang" / rel).is_file():
            continue  # absent in this version: the gate names it
        target = dest_site / "sglang" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_site / "sglang" / rel, target)
    dist = f"sglang-{version}.dist-info"
    shutil.copytree(source_site / dist, dest_site / dist)
    return dest_site / "sglang"


def run_python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None,
               extra_path: list[Path] | None = None, python: str | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter that sees the real sglang files (and our editable
    install, through the test venv): the way SGLang's processes see the plugin."""
    path = [str(p) for p in (extra_path or [])] + [str(sglang_site())]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_", "SGLANG_"))}
    child_env["PYTHONPATH"] = os.pathsep.join(path)
    child_env.update(env or {})
    return subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env, cwd=cwd, timeout=120)


BYPASS_SGLANG_INIT = (
    "from ddtree.sglang.probe import bypass_sglang_init\n"
    "assert bypass_sglang_init()\n"
)


# What `import torch` (and so `import ddtree`) needs, borrowed from the test venv by symlink:
# a real SGLang host has torch; a 700 MB copy per test would not help the test.
TORCH_MODULES = ("torch", "torchgen", "typing_extensions.py", "sympy", "mpmath", "networkx", "jinja2",
                 "markupsafe", "fsspec", "filelock", "numpy", "numpy.libs")


def make_sglang_venv(root: Path) -> Path:
    """A real virtual environment with sglang==0.5.23 installed by pip --no-deps, plus torch
    (symlinked, outside site-packages) the way a GPU host's environment has it. Returns its python."""
    import sysconfig

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    wheel = sglang_wheel("%d.%d" % sys.version_info[:2])  # the venv's own interpreter version
    # --no-compile: byte-compiling all of sglang costs more than the tests' own imports of it
    _pip("--python", str(python), "install", "--no-deps", "--no-index", "--no-compile", str(wheel))
    borrowed = root / "borrowed-torch"
    borrowed.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for name in TORCH_MODULES:
        if (here / name).exists():
            (borrowed / name).symlink_to(here / name)
    (site_dir(python) / "borrowed_torch.pth").write_text(str(borrowed) + "\n")
    return python


def release_snapshot(root: Path) -> Path:
    """A frozen copy of the files a release is built from (the core and the host side), to
    deploy from while other tests change the checkout: root/checkout."""
    snapshot = root / "checkout"
    for rel in ("src/ddtree", "ddtree_ops/hostside", "ddtree_ops/__init__.py"):
        if (REPO / rel).is_file():
            shutil.copy(REPO / rel, snapshot / rel)
        else:
            shutil.copytree(REPO / rel, snapshot / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return snapshot


def venv_and_snapshot(root: Path) -> tuple[Path, Path]:
    """What a deploy test works with: (an SGLang venv's python, a frozen release snapshot), under root."""
    return make_sglang_venv(root), release_snapshot(root)


def wrapped_python(python: Path, name: str, shell: str = "") -> Path:
    """An executable `name` next to the venv's `python` (so the same environment) that runs the
    bash lines `shell` first, then the real interpreter under the wrapper's own name."""
    wrapper = Path(python).parent / name
    wrapper.write_text(f'#!/bin/bash\n{shell}exec -a "$0" {Path(python).resolve()} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


# sha256 by (path, inode, size, mtime, ctime): any write, rename or chmod moves the ctime,
# so a file whose key is unchanged holds the bytes hashed before (sglang alone is ~2000 files)
_HASHED: dict[tuple[str, int, int, int, int], str] = {}
_SITES: dict[Path, Path] = {}


def site_dir(python: Path) -> Path:
    """The environment's site-packages (asked of its python once)."""
    if python not in _SITES:
        _SITES[python] = Path(subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True).stdout.strip())
    return _SITES[python]


def site_listing(python: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under the environment's site-packages."""
    import hashlib

    site = site_dir(python)
    listing = {}
    for path in sorted(site.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        stat = path.stat()  # follows links, as read_bytes does
        key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        if key not in _HASHED:
            _HASHED[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        listing[str(path.relative_to(site))] = _HASHED[key]
    return listing
