"""The machine's CPU time so far, from the first line of /proc/stat (Linux).

Fields in jiffies, all CPUs together: user, nice, system, idle, iowait, irq, softirq, steal
(the time the hypervisor ran another guest on this VM's CPUs), ... The benchmarks read it to
say how busy, or how shared, the host was while they timed something.
"""
from __future__ import annotations

from pathlib import Path

IDLE, IOWAIT, STEAL = 3, 4, 7


def cpu_fields() -> list[int] | None:
    """The jiffy counters of /proc/stat's `cpu` line, or None where there is no /proc/stat."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
