"""`ddtree.op_threads`: the fast builder's small ops run on one thread, its full-row passes with
the caller's threads, and the caller's count is back when the build ends (also on an error)."""
from __future__ import annotations

import pytest
import torch

from ddtree import build_ddtree_tree_from_logits
from ddtree import row_select
from ddtree.op_threads import callers_threads, small_ops_on_one_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_the_callers_count_in_a_pass_and_back_after(two_threads):
    host = torch.zeros(2, 3)
    with small_ops_on_one_thread(host):
        assert torch.get_num_threads() == 1
        with callers_threads():
            assert torch.get_num_threads() == 2
            with callers_threads():  # a pass inside a pass changes nothing
                assert torch.get_num_threads() == 2
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with small_ops_on_one_thread(host):  # a build inside a build keeps the outer caller's count
            with callers_threads():
                assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_the_count_is_restored_when_the_block_raises(two_threads):
    with pytest.raises(RuntimeError, match="boom"):
        with small_ops_on_one_thread(torch.zeros(1)):
            with callers_threads():
                raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_outside_a_build_and_for_rows_off_the_host_nothing_changes(two_threads):
    with callers_threads():
        assert torch.get_num_threads() == 2
    with small_ops_on_one_thread(torch.empty(2, 3, device="meta")):
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("budget", [16, 256, 1024])
def test_a_fast_build_runs_its_passes_with_the_callers_threads_and_the_rest_on_one(two_threads, monkeypatch, budget):
    """Record the thread count where the build reads ranks from a few blocks and where it takes
    the block maxima (a max is exact in any order: on one thread too); the tree is the heap's,
    bit for bit."""
    seen: dict[str, set[int]] = {"blocks": set(), "maxima": set()}

    def spy(name, function):
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            seen[name].add(torch.get_num_threads())
            return result
        return wrapped

    monkeypatch.setattr(row_select, "_sorted_per_row", spy("blocks", row_select._sorted_per_row))
    monkeypatch.setattr(row_select, "_read_of_top", spy("blocks", row_select._read_of_top))
    monkeypatch.setattr(row_select, "_block_view", spy("maxima", row_select._block_view))
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(15, 151936, generator=generator) * 3.0  # large vocabulary: block-maxima reads
    logits[:, :40] += 12.0  # a few likely tokens per row: a deep tree

    tree = build_ddtree_tree_from_logits(logits, budget, method="fast")

    assert seen["blocks"] == {1} and seen["maxima"] == {1}
    assert torch.get_num_threads() == 2
    heap = build_ddtree_tree_from_logits(logits, budget, method="heap")
    assert tree.parents == heap.parents and tree.node_scores_list == heap.node_scores_list


def test_the_logsumexp_pass_sees_the_callers_threads(two_threads, monkeypatch):
    """A row's logsumexp (its float sum must be split as the reference's is) runs with the
    caller's threads; logsumexps of the small block-maxima table do not count here."""
    counts: list[int] = []
    real = torch.logsumexp

    def recording_logsumexp(x, *args, **kwargs):
        if x.shape[-1] == 151936:
            counts.append(torch.get_num_threads())
        return real(x, *args, **kwargs)

    monkeypatch.setattr(row_select, "logsumexp_replica_holds", lambda: False)  # take torch.logsumexp itself
    monkeypatch.setattr(torch, "logsumexp", recording_logsumexp)
    logits = torch.randn(15, 151936, generator=torch.Generator().manual_seed(3))

    build_ddtree_tree_from_logits(logits, 256, method="fast")

    assert counts and set(counts) == {2}
