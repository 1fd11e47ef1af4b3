"""Every command README.md and docs/ print is run exactly as written, at a terminal (a pty, as a
person pastes it), or carries a tag saying why not (doc_commands.py; docs/dev/extending.md).

Each doc runs in a sandbox of its own: a copy of this checkout (its `.venv` and `.cache` are
links to this one's: `. .venv/bin/activate` works), a HOME of its own, and a hosts.yaml with
the hosts the doc names: `local`, and real sshd hosts on 127.0.0.1 (one fleet for the module)
whose `python:` is this test's, or a venv with the real sglang 0.5.23 where the doc deploys,
or a path that is not there where the doc shows that failure. The files a doc presumes (the
README's `expected.json`) are written first; `RUN_ID` stands for the newest run in ./runs. The
commands of a doc run in order in one shell, so one step sees what the last one made.

A failure names the doc line of each command that failed: fix the doc (or the code), or tag
the command."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from sshd_fleet import SshdFleet, sshd_available
from terminal.doc_commands import FENCE, TAGS, DocCommand, doc_files, shell_blocks
from terminal.operator_shell import TIMEOUT_S
from terminal.pty_run import run_in_pty

REPO = Path(__file__).resolve().parents[2]
DOCS = [path.relative_to(REPO).as_posix() for path in doc_files(REPO)]


@dataclass(frozen=True)
class SandboxHost:
    python: str = "this"  # "this": the test's python; "sglang": a venv with sglang 0.5.23; else a path
    groups: tuple[str, ...] = ()


LOCAL = "local"
SGLANG = SandboxHost(python="sglang")
# The hosts each doc's sandbox inventory has: what its commands and examples name, no more (a
# command without -H runs on every host, and the sweeps cost seconds per host). A doc not
# listed gets `local` alone.
SANDBOX_HOSTS: dict[str, dict[str, object]] = {
    "README.md": {"local": LOCAL, "gpu-a": SandboxHost("sglang", ("h200",)), "gpu-b": SandboxHost(groups=("h200",))},
    # the canary example: gpu-01, first, has no python there (`local` last: the rollout stops before it)
    "docs/operator-guide.md": {"gpu-01": SandboxHost(python="/opt/missing/python3"), "gpu-02": SandboxHost(),
                               "gpu-03": SandboxHost(), "gpu-04": SandboxHost(), "local": LOCAL},
    # the rollout example: gpu-01 deploys, gpu-02 has no sglang, gpu-03 is never reached
    "docs/sglang-plugin.md": {"gpu-01": SGLANG, "gpu-02": SandboxHost(), "gpu-03": SandboxHost(),
                              "gpu-a": SGLANG},
    "docs/smoke.md": {"gpu-a": SandboxHost("sglang", ("h200",))},
    "docs/observing.md": {"gpu-a": SandboxHost("sglang", ("h200",))},
}
# Files a doc's commands presume in the working folder.
SANDBOX_FILES = {
    "README.md": {"expected.json": json.dumps({"metrics": [{"metric": "env.status", "expected": "pass"}]})},
}


def commands_of(doc: str) -> list[DocCommand]:
    return [command for block in shell_blocks(REPO / doc, REPO) for command in block.commands]


def test_every_shell_block_is_read_and_every_tag_is_known():
    """Quick: the blocks parse (an unknown tag fails here, naming its line), and no command hides
    in a block whose language is not a shell's (a `$ ` prompt in a plain ``` block)."""
    for doc in DOCS:
        commands_of(doc)
        fenced, language = False, ""
        for number, line in enumerate((REPO / doc).read_text().splitlines(), start=1):
            fence = FENCE.match(line)
            if fence:
                fenced, language = not fenced, fence.group(3)
                continue
            assert not (fenced and language == "" and line.startswith("$ ")), \
                f"{doc}:{number}: a command in a ``` block without a language: make it ```console"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not sshd_available():
        pytest.skip("OpenSSH sshd/ssh-keygen not installed (scripts/bootstrap.sh installs them)")
    fleet = SshdFleet(tmp_path_factory.mktemp("doc-fleet"), command_timeout=300)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def sglang_pythons(tmp_path_factory):
    """One venv with sglang 0.5.23 per host that needs one (a deploy writes into it)."""
    from sglang_plugin.dist import make_sglang_venv

    made: dict[str, Path] = {}

    def for_host(name: str) -> Path:
        if name not in made:
            made[name] = make_sglang_venv(tmp_path_factory.mktemp(f"sglang-{name}"))
        return made[name]

    return for_host


def sandbox_inventory(doc: str, fleet: SshdFleet, sglang_pythons, home: Path) -> dict:
    hosts: dict[str, dict] = {}
    for name, spec in SANDBOX_HOSTS.get(doc, {"local": LOCAL}).items():
        if spec == LOCAL:
            hosts[name] = {"transport": "local", "python": sys.executable}
            continue
        host = next((h for h in fleet.hosts if h.name == name), None) or fleet.add_host(name)
        python = {"this": sys.executable, "sglang": None}.get(spec.python, spec.python)
        hosts[name] = {**fleet.host_entry(host), "groups": list(spec.groups),
                       "python": str(python or sglang_pythons(name))}
    return {"defaults": fleet.inventory_dict()["defaults"], "hosts": hosts}


def make_sandbox(doc: str, root: Path, fleet, sglang_pythons) -> tuple[Path, dict[str, str]]:
    checkout, home = root / "checkout", root / "home"
    home.mkdir(parents=True)
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True,
                             check=True).stdout.split("\0")
    for relpath in filter(None, tracked):
        if (REPO / relpath).is_file():
            (checkout / relpath).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / relpath, checkout / relpath)
    (checkout / ".venv").symlink_to(Path(sys.prefix))
    if (REPO / ".cache").is_dir():
        (checkout / ".cache").symlink_to(REPO / ".cache")
    (checkout / "hosts.yaml").write_text(yaml.safe_dump(sandbox_inventory(doc, fleet, sglang_pythons, home)))
    for name, text in SANDBOX_FILES.get(doc, {}).items():
        (checkout / name).write_text(text)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DDTREE_", "SGLANG_"))}
    env.update(HOME=str(home), PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return checkout, env


MARK = "@@doc-command"


def shell_script(commands: list[DocCommand]) -> str:
    """The doc's commands in order, each followed by a line with its exit status."""
    lines = ["newest_run() { ls -1 runs 2>/dev/null | sort | tail -n 1; }"]
    for index, command in enumerate(commands):
        text = re.sub(r"\bRUN_ID\b", "$(newest_run)", command.as_run)
        lines += [text, f'echo "{MARK} {index} $?"']
    return "\n".join(lines) + "\n"


def sglang_cpu_env_ready() -> bool:
    stamp = REPO / ".cache" / "sglang-cpu-venv" / ".ddtree-sglang-cpu"
    return stamp.is_file()


@pytest.mark.slow
@pytest.mark.sshd
@pytest.mark.parametrize("doc", [doc for doc in DOCS if commands_of(doc)])
def test_the_docs_commands_run_as_written(doc, fleet, sglang_pythons, tmp_path):
    commands = [command for command in commands_of(doc) if command.runs]
    if any("sglang_cpu_env.sh" in c.text for c in commands) and not sglang_cpu_env_ready():
        pytest.skip("the SGLang CPU env is not built: `make test` builds it (scripts/sglang_cpu_env.sh)")
    checkout, env = make_sandbox(doc, tmp_path, fleet, sglang_pythons)
    script = tmp_path / "commands.sh"
    script.write_text(shell_script(commands))
    result = run_in_pty(["bash", str(script)], timeout_s=TIMEOUT_S * max(len(commands), 1), cwd=str(checkout),
                        env=env)
    statuses = {int(i): int(code) for i, code in re.findall(rf"{MARK} (\d+) (\d+)", result.text)}
    failures = []
    for index, command in enumerate(commands):
        got = statuses.get(index)
        if got != command.expected_exit:
            outcome = "never finished (hung?)" if got is None else f"exited {got}"
            failures.append(f"{command.where}: `{command.text}` {outcome}, the doc expects {command.expected_exit}")
    assert not failures, (
        "\n".join(failures) + f"\nFix the doc or the code, or tag the command ({', '.join(f'[{t}]' for t in TAGS)}; "
        "docs/dev/extending.md). What the terminal showed, last part:\n" + result.text[-4000:])
