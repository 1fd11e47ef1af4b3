"""The row logsumexp split between the building thread and the worker thread: the heap's bits
on every split, one intra-op thread in the worker, no job outliving its build, errors named."""
import multiprocessing
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from ddtree import build_ddtree_tree_from_logits, fast_build, row_logsumexp, row_select
from ddtree.op_threads import build_callers_threads, callers_threads, small_ops_on_one_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from row_families import family_logits  # noqa: E402  (the benchmark's seeded row families)

VOCAB = 151936  # block reads, as the benchmark's rows


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the split runs only for a caller with exactly two
    yield
    torch.set_num_threads(before)


def _same_tree(a, b) -> bool:
    return a.parents == b.parents and a.node_token_ids_list == b.node_token_ids_list and a.node_scores_list == b.node_scores_list


def test_the_split_gives_torchs_bits_on_every_split_and_both_recipes(two_threads):
    assert row_logsumexp.split_replica_holds()
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(7, 70001, generator=generator) * 3.0
    x[1, ::3] = float("-inf")
    x[4] = x[4].bfloat16().float()  # coarse values: many exact ties
    x[6] = float("-inf")  # a row with no finite logit
    expected = torch.logsumexp(x, dim=-1).tolist()  # the reference's call, on two threads
    for split in range(1, 7):
        for row_max in (None, x.amax(dim=-1)):
            head = row_logsumexp.start_rows(x, 0, split, None if row_max is None else row_max[:split])
            with small_ops_on_one_thread(x):  # this side as inside a build: one thread
                tail = row_logsumexp.rows_log_z(x[split:], None if row_max is None else row_max[split:]).tolist()
            assert head.result() + tail == expected, (split, row_max is None)


def test_the_worker_runs_on_one_thread_and_leaves_every_other_threads_count(two_threads):
    assert row_logsumexp._the_worker().submit(torch.get_num_threads).result() == 1
    logits = family_logits("peaked", 0, 15, VOCAB)
    build_ddtree_tree_from_logits(logits, 256)
    assert torch.get_num_threads() == 2
    seen = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [2]  # a thread started after a build is seeded with the caller's count


@pytest.mark.parametrize("family", ["peaked", "power-1.5-sharp", "power-2.0", "mixed-depths", "peaked@T0.5"])
@pytest.mark.parametrize("budget", [16, 256, 1024])
def test_split_builds_are_the_heaps_tree(two_threads, monkeypatch, family, budget):
    """Trees likely deep start the worker early; every build that splits gives the heap's tree."""
    started = []
    real_start = row_logsumexp.start_rows
    monkeypatch.setattr(row_select, "start_rows", lambda *a, **k: started.append(a[1:3]) or real_start(*a, **k))
    for seed in range(2):
        logits = family_logits(family, seed, 15, VOCAB)
        tree = build_ddtree_tree_from_logits(logits, budget)
        assert _same_tree(tree, build_ddtree_tree_from_logits(logits, budget, method="heap")), (family, seed)
    assert started  # the split ran


def test_bfloat16_rows_split_to_the_heaps_tree(two_threads):
    logits = family_logits("power-1.5-sharp", 3, 15, VOCAB).bfloat16()
    assert _same_tree(build_ddtree_tree_from_logits(logits, 1024), build_ddtree_tree_from_logits(logits, 1024, method="heap"))


def test_a_build_returns_only_after_the_workers_rows_are_done(two_threads, monkeypatch):
    finished = []
    real = row_logsumexp.rows_log_z

    def slow_rows_log_z(rows, row_max):
        result = real(rows, row_max)
        if threading.current_thread().name == "ddtree-logsumexp":
            time.sleep(0.05)  # a worker far slower than this thread
            finished.append(time.perf_counter())
        return result

    monkeypatch.setattr(row_logsumexp, "rows_log_z", slow_rows_log_z)
    logits = family_logits("power-1.5-sharp", 0, 15, VOCAB)
    tree = build_ddtree_tree_from_logits(logits, 1024)
    returned = time.perf_counter()
    assert finished and max(finished) <= returned
    assert _same_tree(tree, build_ddtree_tree_from_logits(logits, 1024, method="heap"))


def test_rows_started_early_and_never_read_are_waited_for(two_threads):
    logits = family_logits("peaked", 0, 15, VOCAB)
    reader = fast_build._RowReader(logits, 1024)
    with small_ops_on_one_thread(logits):
        row_select.start_rows_early(reader, 9)
        pending = reader.pending_rows
        assert pending is not None and (pending.start, pending.stop) == (0, 9)
        row_select.settle_rows(reader)
    assert reader.pending_rows is None and pending.log_z.done()
    assert reader.log_z == {}  # settling normalises nothing


def test_rows_started_early_are_picked_up_by_the_first_normalisation(two_threads):
    logits = family_logits("peaked", 1, 15, VOCAB)
    reader = fast_build._RowReader(logits, 1024)
    with small_ops_on_one_thread(logits):
        row_select.start_rows_early(reader, 9)
        reader._normalise(list(range(15)))
    assert reader.pending_rows is None
    assert [reader.log_z[d] for d in range(15)] == torch.logsumexp(logits, dim=-1).tolist()


def test_block_read_builds_give_the_worker_rows_0_and_1_before_the_depth_guess(two_threads, monkeypatch):
    at_guess = []
    real_guess = fast_build._guess_depth
    monkeypatch.setattr(fast_build, "_guess_depth", lambda reader: at_guess.append(reader.pending_rows) or real_guess(reader))
    for family in ("flat", "peaked", "power-1.5"):  # a depth-one tree, a deep one, one read through the maxima
        logits = family_logits(family, 0, 15, VOCAB)
        tree = build_ddtree_tree_from_logits(logits, 1024)
        assert _same_tree(tree, build_ddtree_tree_from_logits(logits, 1024, method="heap")), family
    assert [(p.start, p.stop, p.extendable) for p in at_guess] == [(0, row_select.HEAD_START_ROWS, True)] * 3


def test_the_early_rows_are_queued_behind_the_head_start(two_threads):
    logits = family_logits("peaked", 2, 15, VOCAB)
    reader = fast_build._RowReader(logits, 1024)
    with small_ops_on_one_thread(logits):
        row_select.start_head_rows(reader)
        row_select.start_rows_early(reader, 10)
        pending = reader.pending_rows
        assert (pending.start, pending.stop, pending.extendable) == (0, 10, False)
        row_select.start_rows_early(reader, 12)  # no second extension: the share is set
        assert reader.pending_rows is pending
        reader._normalise(list(range(15)))
    assert reader.pending_rows is None
    assert [reader.log_z[d] for d in range(15)] == torch.logsumexp(logits, dim=-1).tolist()


@pytest.mark.parametrize("rows", [2, 9, 15])
def test_a_normalisation_splits_the_rows_past_a_head_start(two_threads, monkeypatch, rows):
    """Rows 0-1 alone: the head start is picked up as it is; more rows: the worker's share of
    those past it is queued behind it. The reference's bits either way."""
    extended = []
    real_extend = row_select.extend_rows
    monkeypatch.setattr(row_select, "extend_rows", lambda x, pending, stop: extended.append(stop) or real_extend(x, pending, stop))
    logits = family_logits("power-1.5", 1, 15, VOCAB)
    logits[rows - 1, 5:] = float("-inf")  # the last row normalised has few finite logits
    reader = fast_build._RowReader(logits, 1024)
    with small_ops_on_one_thread(logits):
        row_select.start_head_rows(reader)
        reader._normalise(list(range(rows)))
    assert reader.pending_rows is None
    assert extended == ([] if rows == 2 else [2 + row_select._worker_rows(rows - 2, None)])
    assert [reader.log_z[d] for d in range(rows)] == torch.logsumexp(logits, dim=-1).tolist()[:rows]


@pytest.mark.parametrize(("family", "budget", "shares"), [("peaked", 1024, [10, 11]), ("peaked", 256, [10]), ("power-2.5-sharp", 1024, [10])])
def test_flat_tails_give_the_worker_one_more_row(two_threads, monkeypatch, family, budget, shares):
    """Rows 0-1 ahead, then the worker's 10 of 15 rows (a tree likely deep); where the first
    reads find a flat tail at a budget that takes its floor in advance, one more, queued
    while the reads' gathering runs. The tree is the oracle's."""
    extended = []
    real_extend = row_select.extend_rows
    monkeypatch.setattr(row_select, "extend_rows", lambda x, pending, stop: extended.append(stop) or real_extend(x, pending, stop))
    own_rows = []  # rows this thread normalised beside the worker
    real_rows_log_z = row_select.rows_log_z
    monkeypatch.setattr(row_select, "rows_log_z", lambda rows, row_max: own_rows.append(rows.shape[0]) or real_rows_log_z(rows, row_max))
    logits = family_logits(family, 0, 15, VOCAB)
    tree = build_ddtree_tree_from_logits(logits, budget)
    assert extended == shares
    assert own_rows == [15 - shares[-1]]  # the rows past the worker's share as it finally stood
    assert _same_tree(tree, build_ddtree_tree_from_logits(logits, budget, method="heap"))


@pytest.mark.parametrize("bad_row", [2, 13])  # in the worker's share, in this thread's
def test_a_nan_row_is_named_whichever_thread_summed_it(two_threads, bad_row):
    logits = family_logits("peaked", 0, 15, VOCAB)
    logits[bad_row, 777] = float("nan")
    with pytest.raises(ValueError, match=f"logits row {bad_row} .*NaN .*token 777"):
        build_ddtree_tree_from_logits(logits, 1024)


def test_one_thread_or_more_than_two_keep_the_plain_pass(monkeypatch):
    monkeypatch.setattr(row_select, "start_rows", lambda *a, **k: pytest.fail("split"))
    logits = family_logits("peaked", 0, 15, VOCAB)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            tree = build_ddtree_tree_from_logits(logits, 1024)
            assert _same_tree(tree, build_ddtree_tree_from_logits(logits, 1024, method="heap"))
    finally:
        torch.set_num_threads(before)


def test_the_callers_count_is_known_only_between_a_builds_passes(two_threads):
    host = torch.zeros(2, 3)
    assert build_callers_threads() is None
    with small_ops_on_one_thread(host):
        assert build_callers_threads() == 2
        with callers_threads():
            assert build_callers_threads() is None  # inside a full-row pass: no split
    assert build_callers_threads() is None


def _child_builds(logits, queue) -> None:
    torch.set_num_threads(2)
    tree = build_ddtree_tree_from_logits(logits, 256)
    queue.put((tree.parents, tree.node_scores_list))


@pytest.mark.slow
def test_a_forked_child_builds_with_its_own_worker(two_threads):
    logits = family_logits("power-1.5-sharp", 0, 15, VOCAB)
    parent = build_ddtree_tree_from_logits(logits, 256)  # the parent's worker exists now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_builds, args=(logits, queue))
    child.start()
    try:
        parents, scores = queue.get(timeout=60)  # a child waiting on the parent's worker never answers
        child.join(timeout=60)
    finally:
        child.kill()
    assert child.exitcode == 0
    assert (parents, scores) == (parent.parents, parent.node_scores_list)


@pytest.mark.slow
def test_a_process_that_exits_with_a_job_under_way_exits_cleanly():
    """A build interrupted while it waited (Ctrl-C) leaves the worker inside a torch op; the
    interpreter must let it finish rather than abort ("terminate called", exit 134)."""
    script = (
        "import torch\n"
        "from ddtree import row_logsumexp\n"
        "rows = torch.randn(64, 151936)\n"
        "row_logsumexp.start_rows(rows, 0, 64)\n"  # never waited for
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate" not in done.stderr


def test_an_owner_without_early_rows_is_normalised_split_all_the_same(two_threads):
    """`pending_rows` is optional on a normalisation's owner (the frontier oracle's rows have
    none): inside a build a pass over block-read rows still splits and gives torch's bits."""
    logits = family_logits("power-1.5-sharp", 2, 15, VOCAB)
    owner = types.SimpleNamespace(logits=logits, depth_limit=15, log_z={}, dead_from=15, source=row_select.BlockMaxima(logits))
    started = []
    real_start = row_logsumexp.start_rows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(row_select, "start_rows", lambda *a, **k: started.append(a[1:3]) or real_start(*a, **k))
        with small_ops_on_one_thread(logits):
            row_select.normalise_rows(owner, list(range(15)))
    assert started == [(0, 8)]  # half the rows to the worker
    assert [owner.log_z[d] for d in range(15)] == torch.logsumexp(logits, dim=-1).tolist()
    assert not hasattr(owner, "pending_rows")
