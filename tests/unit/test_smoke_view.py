"""The smoke live table (ddtree_ops/cli/smoke.py SmokeView) with an injected clock: silence
shown before a host is lost, the runner's start-up named, details cleared per stage and never
cut inside a value, and a 2,000-host fleet drawn from a snapshot within the screen."""
from __future__ import annotations

import io

from rich.console import Console

from ddtree_ops.cli.smoke import STARTING, SmokeView, shorten


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drawn(view: SmokeView, height: int | None = None) -> str:
    console = Console(width=220, height=height or 100, record=True, file=io.StringIO())
    console.print(view.render(height))
    return console.export_text()


def test_silence_is_shown_after_10s_and_cleared_by_any_line():
    clock = Clock()
    view = SmokeView("smoke", ["gpu-a", "gpu-b"], clock=clock)
    view.phase("gpu-a", "running")
    view.phase("gpu-b", "running")
    assert view.hosts["gpu-a"].phase == STARTING == "starting: importing torch"
    clock.now += 9.0
    assert "last heard" not in drawn(view)  # no column before 10 s of silence
    view.heard("gpu-b")  # a blank keepalive line
    clock.now += 18.0
    text = drawn(view)
    assert "last heard" in text
    row_a = next(line for line in text.splitlines() if "gpu-a" in line)
    row_b = next(line for line in text.splitlines() if "gpu-b" in line)
    assert "silent 27s" in row_a and "silent 18s" in row_b
    view.record("gpu-a", {"event": "run_start", "stages": ["env", "tree-bench"]})
    text = drawn(view)
    assert "silent" not in next(line for line in text.splitlines() if "gpu-a" in line)
    assert "running" in next(line for line in text.splitlines() if "gpu-a" in line)
    view.phase("gpu-b", "failed", "gpu-b: connection lost: sent nothing for 60s")
    clock.now += 30.0
    text = drawn(view)
    assert "silent 30s" in next(line for line in text.splitlines() if "gpu-a" in line)
    assert "silent" not in next(line for line in text.splitlines() if "gpu-b" in line)  # settled: not silent


def test_a_stage_start_clears_the_detail_and_details_keep_whole_values():
    view = SmokeView("smoke", ["gpu-a"], clock=Clock())
    view.phase("gpu-a", "running")
    view.record("gpu-a", {"event": "run_start", "stages": ["lossless", "tree-bench"]})
    view.record("gpu-a", {"event": "stage_start", "stage": "lossless"})
    view.record("gpu-a", {"event": "log", "stage": "lossless", "message": "chi-square p=0.4312"})
    assert view.hosts["gpu-a"].detail == "chi-square p=0.4312"
    view.record("gpu-a", {"event": "stage_start", "stage": "tree-bench"})
    assert view.hosts["gpu-a"].detail == ""
    message = "bs 16 budget 1024: " + ", ".join(f"builder{i} 1.463{i} ms" for i in range(12))
    view.record("gpu-a", {"event": "log", "stage": "tree-bench", "message": message})
    detail = view.hosts["gpu-a"].detail
    assert len(detail) <= 82 and detail.endswith(" …")
    kept = detail[:-2].split(" ")
    assert all(word in message.split(" ") for word in kept)  # whole words: no number cut short
    assert shorten("x" * 100, 10) == "x" * 10 + " …"  # one word longer than the limit: cut there
    assert "budget 1024" in drawn(view)  # folded in the table, not elided


def test_a_fleet_past_the_screen_height_is_summarised_and_drawn_outside_the_lock(monkeypatch):
    clock = Clock()
    names = [f"gpu-{i:04d}" for i in range(2000)]
    view = SmokeView("smoke", names, clock=clock)
    for name in names[:1500]:
        view.phase(name, "done")
    for name in names[1500:1510]:
        view.phase(name, "running")
        view.record(name, {"event": "run_start", "stages": ["env"]})
    view.phase("gpu-1510", "unreachable", "gpu-1510: unreachable: cannot resolve")
    import rich.table

    real_add_row = rich.table.Table.add_row
    held = []

    def add_row(self, *cells, **kw):
        held.append(view.lock.locked())
        return real_add_row(self, *cells, **kw)

    monkeypatch.setattr(rich.table.Table, "add_row", add_row)
    text = drawn(view, height=40)
    assert len(text.splitlines()) <= 40
    assert "2000 hosts: 1500 done, 10 running, 1 unreachable, 489 queued; 1989 not shown" in " ".join(text.split())
    assert "gpu-1500" in text and "gpu-1510" in text and "gpu-0000" not in text  # those under way first
    assert held and not any(held)  # host threads never wait for a frame
    assert "unreachable: unreachable" not in text
