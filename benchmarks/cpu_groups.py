"""Give each loopback host its own CPU budget, as separate machines would have.

The loopback fleet's hosts share this machine's few cores, so N hosts doing CPU work (a torch
import each) take ~N/cores times as long as one, whatever the operator side does. Capping each
host's sshd, and so every session and command it forks, at a fixed share of a core in its own
cgroup makes one host equally slow whether it runs alone or beside others, so the 1-host vs
N-host wall-time ratio measures the fan-out itself. Needs root and a cgroup-v1 `cpu`
controller (`cpu.cfs_quota_us`, what this project's machine has); `unavailable()` says why not.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

CPU_HIERARCHY = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable() -> str | None:
    """Why CPU caps cannot be set here, or None when they can."""
    if os.geteuid() != 0:
        return "CPU caps need root"
    if not (CPU_HIERARCHY / "cpu.cfs_quota_us").is_file() or not os.access(CPU_HIERARCHY, os.W_OK):
        return f"no writable cgroup-v1 cpu controller at {CPU_HIERARCHY}"
    return None


@contextlib.contextmanager
def capped(pids: dict[str, int], cores: float) -> Iterator[None]:
    """Move each named process (and what it forks from then on) into its own group capped at
    `cores` of CPU time per wall second; on exit, move whatever is left back and remove them."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    groups = []
    try:
        for name, pid in pids.items():
            group = CPU_HIERARCHY / f"ddtree-bench-{os.getpid()}-{name}"
            group.mkdir()
            groups.append(group)
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(cores * PERIOD_US))))
            (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for group in groups:
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # exited since
                    (CPU_HIERARCHY / "cgroup.procs").write_text(pid)
            group.rmdir()
