"""scripts/bootstrap.sh prints its phases and, for the test suite, stops at once (saying what to
run) when sshd is missing and the user cannot install it; it installs the exact versions of
constraints/ddtree-ops.txt and installs again when pyproject.toml, that file or TORCH_SPEC
changed. Run with a PATH that has no sshd, rsync or apt-get and an `id` that says a non-root
user; the venv's `python` is a stand-in that records the pip commands it is given."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints" / "ddtree-ops.txt"
TOOLS = ("dirname", "cat", "cut", "sed", "head", "sha256sum", "sleep", "bash")


def run_bootstrap(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    (tools / "id").write_text("#!/bin/sh\necho 1000\n")
    (tools / "id").chmod(0o755)
    links = {tool: shutil.which(tool) for tool in TOOLS} | {"python3": str(Path(sys.executable).resolve())}
    for tool, target in links.items():
        (tools / tool).unlink(missing_ok=True)
        (tools / tool).symlink_to(target)
    return subprocess.run([shutil.which("bash"), str(REPO / "scripts" / "bootstrap.sh")], capture_output=True, text=True,
                          timeout=120, env={"PATH": str(tools), "HOME": str(tmp_path),
                                            "SSHD": str(tmp_path / "no-sshd"), **env})


def recording_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python logs its arguments (one line per call) and succeeds."""
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    (venv / "bin" / "python").chmod(0o755)
    return venv, log


def stamp_for(torch_spec: str = "torch==2.13.0") -> str:
    """What a venv set up from this checkout's pyproject.toml and pins records."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + CONSTRAINTS.read_bytes()).hexdigest()
    return f"{digest} {torch_spec} {sys.version_info[0]}.{sys.version_info[1]}\n"


def test_no_sshd_and_not_root_stops_the_test_setup_at_once(tmp_path):
    venv = tmp_path / "venv"
    done = run_bootstrap(tmp_path, BOOTSTRAP_NEEDS_SSHD="1", VENV=str(venv))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == "bootstrap: [1/4] system packages (openssh-server openssh-client rsync)"
    assert "sshd is not installed and this user cannot install it" in done.stderr
    assert "run:  sudo apt-get install -y openssh-server openssh-client rsync" in done.stderr
    assert not venv.exists() and "[2/4]" not in done.stderr  # nothing slow was started


def test_without_the_test_suite_it_is_a_note_and_an_up_to_date_venv_is_left_alone(tmp_path):
    venv, log = recording_venv(tmp_path)
    (venv / ".ddtree-ops-installed").write_text(stamp_for())
    done = run_bootstrap(tmp_path, VENV=str(venv))
    assert done.returncode == 0, done.stderr
    assert "note: missing some of openssh-server openssh-client rsync (only the test suite needs them)" in done.stderr
    assert f"bootstrap: [2/4] virtual environment {venv}: up to date" in done.stderr
    assert done.stderr.splitlines()[-1] == "bootstrap: ready"
    assert not log.exists()  # nothing installed


@pytest.mark.parametrize("stale", ["no stamp", "pyproject.toml or the pins changed", "another TORCH_SPEC"])
def test_installs_the_pinned_versions_when_anything_they_come_from_changed(tmp_path, stale):
    venv, log = recording_venv(tmp_path)
    if stale != "no stamp":
        old = stamp_for("torch==2.12.0") if stale == "another TORCH_SPEC" else "0" * 64 + " torch==2.13.0 3.11\n"
        (venv / ".ddtree-ops-installed").write_text(old)
    done = run_bootstrap(tmp_path, VENV=str(venv))
    assert done.returncode == 0, done.stderr
    if stale != "no stamp":
        assert "changed since" in done.stderr and "installing again" in done.stderr
    calls = log.read_text().splitlines()
    pins = f"-c {CONSTRAINTS.relative_to(REPO)}"
    assert [c for c in calls if "torch==2.13.0" in c] == [f"-m pip install -q --disable-pip-version-check {pins} torch==2.13.0"]
    [project] = [c for c in calls if "-e .[test]" in c]
    assert pins in project and f"--build-constraint {CONSTRAINTS.relative_to(REPO)}" in project
    assert all(pins in c for c in calls)  # pip itself too: nothing unpinned
    assert (venv / ".ddtree-ops-installed").read_text() == stamp_for()
    phases = [line for line in done.stderr.splitlines() if line.startswith("bootstrap: [")]
    assert [p[:16] for p in phases] == ["bootstrap: [1/4]", "bootstrap: [2/4]", "bootstrap: [3/4]", "bootstrap: [4/4]"]
    assert all("min" in p or "seconds" in p for p in phases[1:]), phases  # each says how long it takes


def test_the_pins_are_exact_and_leave_torch_to_torch_spec():
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")]
    assert lines, CONSTRAINTS
    not_exact = [line for line in lines if "==" not in line or " @ " in line]
    assert not_exact == [], not_exact
    names = {line.split("==")[0].lower() for line in lines}
    assert "torch" not in names and "ddtree-ops" not in names
    for needed in ("typer", "rich", "paramiko", "pyyaml", "pydantic", "pytest", "pip", "setuptools"):
        assert needed in names, needed
    assert f"# python: {sys.version_info[0]}.{sys.version_info[1]}" in CONSTRAINTS.read_text()


def test_a_long_step_says_it_is_still_at_it_and_how_it_ended(tmp_path):
    """scripts/progress.sh `step`: what the SGLang CPU env build and bootstrap's installs print
    while pip is silent (a line at least every PROGRESS_EVERY_S seconds), and the exit status."""
    script = f'. "{REPO / "scripts" / "progress.sh"}"; step demo "[2/5] a slow step (3 s)" sleep 3; step demo "[3/5] a failing step" false'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PROGRESS_EVERY_S": "1"})
    lines = done.stderr.splitlines()
    assert done.returncode == 1
    assert lines[0] == "demo: [2/5] a slow step (3 s)"
    assert sum(line.startswith("demo:   [2/5] a slow step: still at it (") for line in lines) >= 2
    assert lines[-3].startswith("demo:   done in ") and lines[-2] == "demo: [3/5] a failing step"
    assert lines[-1].startswith("demo:   failed (exit 1) after ")


def test_every_dependency_pyproject_names_is_pinned():
    """A dependency added to pyproject.toml (a merge) without new pins would be installed at
    whatever version is newest that day: refresh them (one command)."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]

    def name(requirement: str) -> str:
        return re.sub(r"[-_.]+", "-", re.split(r"[\s;<>=!~\[(@]", requirement, maxsplit=1)[0]).lower()

    pinned = {name(line) for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")}
    missing = sorted({name(r) for r in wanted} - pinned - {"torch"})  # torch: TORCH_SPEC's
    assert not missing, (f"pyproject.toml names {missing}, which {CONSTRAINTS.relative_to(REPO)} does not pin: "
                         "run `bash scripts/refresh_constraints.sh` and commit the file (docs/dev/extending.md)")
