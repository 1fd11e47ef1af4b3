"""`ddtree.row_select`: block-maxima reads return exactly what full-row reads return."""
from __future__ import annotations

import pytest
import torch

from ddtree import BuildMethod, build_ddtree_tree_from_logits
from ddtree import row_logsumexp, row_select
from ddtree.row_select import BlockMaxima, FullRows, row_source


def rows(depth: int, vocab: int, seed: int, kind: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=generator) * 2.0
    if kind == "peaked":
        logits[:, torch.randint(0, vocab, (1,), generator=generator)] += 16.0
    elif kind == "masked":
        logits[torch.rand(depth, vocab, generator=generator) < 0.6] = float("-inf")
    elif kind == "tail-max":  # every row's best token sits in the short last block
        logits[:, -1] = 50.0
    return logits


def assert_same_read(ours, reference):
    """Bit-equal float32 log-probs in the same order; the same (log-prob, token) pairs (tens of
    thousands of float32 randn draws hold a few exactly equal values, listed in either order)."""
    assert ours.log_probs == reference.log_probs
    for lp, ids, ref_lp, ref_ids in zip(ours.log_probs, ours.ids, reference.log_probs, reference.ids):
        assert sorted(zip(lp, ids)) == sorted(zip(ref_lp, ref_ids))


@pytest.fixture(params=["numpy", "torch"])
def host_sort(request, monkeypatch):
    """Block reads gather and sort in numpy on the host; torch does both where numpy is not
    there (and on devices)."""
    if request.param == "torch":
        monkeypatch.setattr(row_select, "numpy", None)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [65536, 65536 + 7, 151936])
@pytest.mark.parametrize("kind", ["flat", "peaked", "masked", "tail-max"])
@pytest.mark.parametrize("picked", [[0, 2, 3, 4], [1, 2, 3, 4]])  # rows apart, and a run not from row 0
def test_top_and_at_least_match_full_rows(vocab, kind, picked, host_sort):
    logits = rows(5, vocab, seed=vocab % 97, kind=kind)
    log_z = torch.logsumexp(logits, dim=-1)
    blocks, full = BlockMaxima(logits), FullRows(logits)
    for ks in ([1, 1, 1, 1], [16, 3, 40, 7], [300, 1, 129, 64]):
        ours, reference = blocks.top(picked, ks, log_z[picked]), full.top(picked, ks, log_z[picked])
        assert_same_read(ours, reference)
    cuts = logits[picked].max(dim=-1).values - torch.tensor([0.5, 3.0, 6.0, 9.0])
    limits = [10**6] * 4
    (ours, counts), (reference, full_counts) = blocks.at_least(picked, cuts, limits, log_z[picked]), full.at_least(picked, cuts, limits, log_z[picked])
    assert counts == full_counts
    assert_same_read(ours, reference)
    assert all(len(lp) == n for lp, n in zip(ours.log_probs, counts))


def test_reads_skip_zero_probability_tokens():
    logits = torch.full((2, 70000), float("-inf"))
    logits[0, [5, 69999]] = torch.tensor([1.0, 2.0])
    log_z = torch.logsumexp(logits, dim=-1)
    read = BlockMaxima(logits).top([0], [8], log_z[:1])
    assert read.ids == [[69999, 5]]
    assert read.log_probs == FullRows(logits).top([0], [8], log_z[:1]).log_probs


@pytest.mark.parametrize("one_sort_key", [True, False])
def test_exactly_equal_logits_are_read_in_token_order(one_sort_key, host_sort, monkeypatch):
    """Gathered logits come block by block and are sorted by value; ties come out by token id
    (the order a full-row read gives them), on either sort path, the short tail block too."""
    if not one_sort_key:
        monkeypatch.setattr(row_select, "ONE_SORT_KEY_MAX", 0)
    logits = rows(3, 70003, seed=5, kind="flat")
    tied = [11, 2190, 40000, 70001]  # blocks 0, 68 and 1250 of 2187, then the short tail block
    logits[1, tied] = 30.0
    log_z = torch.logsumexp(logits, dim=-1)
    read, counts = BlockMaxima(logits).at_least([0, 1, 2], torch.tensor([29.0, 29.0, 29.0]), [10, 10, 10], log_z)
    assert counts == [0, 4, 0]
    assert read.ids == [[], tied, []]
    assert read.log_probs[1] == [float(torch.tensor(30.0) - log_z[1])] * 4
    top = BlockMaxima(logits).top([1], [3], log_z[1:2])
    assert top.log_probs == [read.log_probs[1][:3]]


def test_maxima_are_taken_only_for_rows_read():
    logits = rows(6, 70000, seed=1, kind="flat")
    blocks = BlockMaxima(logits)
    blocks.maxima([0, 1])
    assert blocks._ready == [True, True, False, False, False, False]
    whole = 70000 // row_select.BLOCK * row_select.BLOCK
    expected = torch.cat([logits[4, :whole].view(-1, row_select.BLOCK).amax(1), logits[4, whole:].amax(-1, keepdim=True)])  # runs of neighbours
    assert torch.equal(blocks.maxima([4])[0], expected)
    assert blocks._ready == [True, True, False, False, True, False]


def test_source_follows_the_vocabulary_size():
    assert isinstance(row_source(torch.zeros(2, row_select.BLOCK_MIN_VOCAB)), BlockMaxima)
    assert isinstance(row_source(torch.zeros(2, row_select.BLOCK_MIN_VOCAB - 1)), FullRows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_read_like_the_reference(dtype):
    logits = rows(4, 151936, seed=3, kind="peaked").to(dtype)
    for budget in (16, 256):
        fast = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.FAST)
        heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
        assert fast.parents == heap.parents  # half-precision rows tie often: shape and scores agree
        assert fast.node_scores.tolist() == heap.node_scores.tolist()


@pytest.mark.parametrize("row", [0, 3, 14])
def test_nan_in_a_large_vocabulary_names_its_row(row):
    logits = rows(15, 151936, seed=4, kind="flat")  # flat: the tree only reaches rows 0-1
    logits[row, 1234] = float("nan")
    with pytest.raises(ValueError, match=rf"row {row} \(depth {row + 1}\) contains NaN \(first at token 1234\)"):
        build_ddtree_tree_from_logits(logits, 64)


@pytest.mark.parametrize("flat_row", [2, 5])
@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_deep_tree_with_a_flat_row_matches_the_heap(flat_row, scale):
    """Drafter-like rows with one flat row inside (a read of it down to a loose floor clears
    most of its blocks). At scale 0.5 its top log-prob (~ -9.8) stops the tree before it; at
    scale 2.0 (top ~ -5.2) the tree goes through it, and the rows past it are reached only
    through it."""
    logits = rows(15, 151936, seed=7, kind="peaked")
    logits[flat_row] = torch.randn(151936, generator=torch.Generator().manual_seed(8)) * scale
    for budget in (256, 1024):
        fast = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.FAST)
        heap = build_ddtree_tree_from_logits(logits, budget, method=BuildMethod.HEAP)
        assert fast.parents == heap.parents
        assert fast.node_token_ids.tolist() == heap.node_token_ids.tolist()
        assert fast.node_scores.tolist() == heap.node_scores.tolist()
        if scale == 2.0:
            assert heap.max_depth > flat_row + 1  # the tree does go past the flat row
        else:
            assert heap.max_depth == flat_row  # ...or stops right before it


def test_a_low_cut_on_a_flat_row_reads_only_what_the_limit_needs():
    logits = torch.randn(3, 151936, generator=torch.Generator().manual_seed(9))
    log_z = torch.logsumexp(logits, dim=-1)
    cuts = torch.full((3,), -50.0)  # clears every block of every row
    read, counts = BlockMaxima(logits).at_least([0, 1, 2], cuts, [10, 40, 200], log_z)
    reference = FullRows(logits).top([0, 1, 2], [10, 40, 200], log_z)
    assert [lp[: len(ref)] for lp, ref in zip(read.log_probs, reference.log_probs)] == reference.log_probs
    assert all(count >= limit for count, limit in zip(counts, [10, 40, 200]))
    assert all(count < 151936 // 4 for count in counts)  # not the whole row


@pytest.mark.parametrize("k", [1, 5, row_select.TOP_BLOCKS_MAX_K])
def test_small_k_reads_from_the_best_blocks_match_full_rows_even_with_ties(k):
    """The small-k path gathers each row's k best blocks; logits on a coarse grid tie often
    (inside a block, across blocks, at the k-th value)."""
    generator = torch.Generator().manual_seed(k)
    logits = torch.round(torch.randn(4, 65536, generator=generator) * 4) / 2  # steps of 0.5
    logits[1, :40000] = float("-inf")
    log_z = torch.logsumexp(logits, dim=-1)
    picked = [0, 1, 3]
    ours = BlockMaxima(logits).top(picked, [k, k, 1], log_z[picked])
    reference = FullRows(logits).top(picked, [k, k, 1], log_z[picked])
    assert ours.log_probs == reference.log_probs  # bit-equal values, in order
    assert [len(lp) for lp in ours.log_probs] == [k, k, 1]
    for row, lp, ids in zip(picked, ours.log_probs, ours.ids):  # a tie at the k-th value may
        assert len(set(ids)) == len(ids)  # pick another of the tied tokens: each id is a token
        expected = (logits[row, ids] - log_z[row]).tolist()  # with exactly its log-prob
        assert expected == lp


@pytest.mark.parametrize("k", [16, 32, row_select.TOP_BLOCKS_MAX_K])
@pytest.mark.parametrize("picked", [[0, 2, 4, 5, 8, 9, 12, 14], list(range(15))])
def test_wide_small_k_reads_cut_at_a_group_maximum_match_full_rows(k, picked, monkeypatch):
    """Many rows at once go through groups of `BLOCK` blocks (`_top_logits_on_host`): the same
    values as a full-row top-k, on a coarse grid (ties at the cut, inside blocks), ties by
    token, a row whose best token sits in the short tail group the cut leaves out; a row with
    finite logits only there (row 3: no finite group cut) sends the read to the torch path."""
    generator = torch.Generator().manual_seed(k + len(picked))
    logits = torch.round(torch.randn(15, 151936, generator=generator) * 4) / 2  # steps of 0.5
    logits[3, :151900] = float("-inf")  # 36 finite logits, all in the tail group
    logits[5, -1] = 40.0
    log_z = torch.logsumexp(logits, dim=-1)
    monkeypatch.setattr(row_select, "HOST_TOP_MIN_LOGITS", 1)  # a speed threshold: every read here
    served = []
    on_host = BlockMaxima._top_logits_on_host
    monkeypatch.setattr(BlockMaxima, "_top_logits_on_host", lambda *args: served.append(on_host(*args)) or served[-1])
    ks = [k] * len(picked)
    ours = BlockMaxima(logits).top(picked, ks, log_z[picked])
    reference = FullRows(logits).top(picked, ks, log_z[picked])
    assert ours.log_probs == reference.log_probs  # bit-equal values, in order
    assert (served[-1] is None) == (3 in picked)
    for row, lp, ids in zip(picked, ours.log_probs, ours.ids):
        assert len(set(ids)) == len(ids)
        assert (logits[row, ids] - log_z[row]).tolist() == lp
        if served[-1] is not None:
            assert all(lp[i - 1] > lp[i] or ids[i - 1] < ids[i] for i in range(1, len(lp)))  # ties by token
    assert ours.ids[picked.index(5)][0] == 151935


def test_host_block_hits_are_the_blocks_a_full_comparison_clears():
    logits = rows(6, 151936, seed=3, kind="masked")
    blocks = BlockMaxima(logits)
    picked = [0, 2, 3, 5]
    cuts = logits[picked].max(dim=-1).values - torch.tensor([0.5, 2.0, 4.0, 100.0])
    row_of, block = blocks._hits_on_host(picked, cuts)
    expected = (blocks.maxima(picked) >= cuts.unsqueeze(1)).nonzero()
    assert row_of.tolist() == expected[:, 0].tolist() and block.tolist() == expected[:, 1].tolist()
    cuts[1] = float("-inf")
    assert blocks._hits_on_host(picked, cuts) is None  # -inf blocks: the torch path


@pytest.mark.parametrize("source", [FullRows, BlockMaxima])
def test_depth_guesses_bound_the_top_log_prob(source):
    """The guess that steers the reads: an upper bound on each row's top log-prob; a row with
    no finite logit gives no guess (NaN)."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 65536, generator=generator) * 3.0
    logits[1, 123] += 30.0  # one dominant token: its log-prob is near 0
    logits[2] = float("-inf")
    bounds, estimates = source(logits).top_log_prob_guesses([0, 1, 2])
    truth = (logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)).tolist()
    assert bounds[0] >= truth[0] - 1e-6 and bounds[1] >= truth[1] - 1e-6  # float rounding aside
    assert truth[1] > -1e-3 and bounds[1] > -1e-3 and estimates[1] > -1e-3  # the peaked row
    assert truth[0] < -1.0 and estimates[0] < -1.0  # the flat one, estimated as such
    assert estimates[0] <= bounds[0]
    assert bounds[2] != bounds[2] and estimates[2] != estimates[2]


@pytest.mark.parametrize("threads", [1, 2])
def test_logsumexp_from_known_row_maxima_is_torchs_to_the_bit(threads):
    """Block reads normalise rows with the row maxima the block maxima already hold; the
    result must be torch.logsumexp's own bits (the heap's), on every kind of row."""
    assert row_logsumexp.logsumexp_replica_holds()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(threads)
        for rows, vocab, scale in ((2, 65536, 1.0), (15, 151936, 4.0), (7, 100003, 0.1), (3, 32000, 30.0)):
            x = torch.randn(rows, vocab, generator=generator) * scale
            x[0, : vocab // 2] = float("-inf")
            x[1] = x[1].bfloat16().float()  # coarse values: many exact ties
            expected = torch.logsumexp(x, dim=-1)
            got = row_logsumexp.logsumexp_given_max(x, x.amax(dim=-1))
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
        dead = torch.full((2, 70000), float("-inf"))
        assert torch.equal(row_logsumexp.logsumexp_given_max(dead, dead.amax(dim=-1)), torch.logsumexp(dead, dim=-1))
    finally:
        torch.set_num_threads(before)


def test_block_reads_normalise_with_the_maxima_and_keep_the_heaps_log_probs():
    from ddtree import fast_build

    logits = torch.randn(5, 70000, generator=torch.Generator().manual_seed(3)) * 3
    reader = fast_build._RowReader(logits, 1024)
    assert isinstance(reader.source, BlockMaxima)
    reader._normalise([1, 2, 3])
    assert reader.source.has_maxima([1, 2, 3])  # taken for the normalisation
    expected = torch.logsumexp(logits, dim=-1).tolist()
    assert [reader.log_z[d] for d in (1, 2, 3)] == expected[1:4]


@pytest.mark.slow
def test_only_host_rows_are_normalised_through_the_maxima(monkeypatch):
    """The once-per-process check runs on the host's kernels: rows on another device keep
    torch.logsumexp (the meta device stands in for one; it has no values to check)."""
    from ddtree import fast_build

    calls = []
    monkeypatch.setattr(row_logsumexp, "logsumexp_given_max", lambda *a: calls.append(a) or torch.logsumexp(a[0], -1))
    host = fast_build._RowReader(torch.randn(3, 70000), 1024)
    host._normalise([0, 1])
    assert len(calls) == 1
    meta = torch.empty(3, 70000, device="meta")
    reader = fast_build._RowReader(meta, 1024)
    with pytest.raises(Exception):  # meta tensors have no values to read back
        reader._normalise([0, 1])
    assert len(calls) == 1  # the meta rows went to torch.logsumexp, not the maxima path
