"""A request's server acceptance against the offline loop's (ddtree_ops.hostside.acceptance):
SGLang's histogram shape, near-ties found from the offline margins, and the per-request and
per-variant verdicts. Hand-made requests; the real server and loop are in
tests/sglang_server/test_cpu_server_e2e.py."""
from __future__ import annotations

import pytest

from ddtree_ops.hostside import acceptance as acc
from ddtree_ops.hostside.acceptance import OfflineRequest, Verdict


def offline(lengths, margins=None, draft=None, prefill=5.0, tokens=None):
    """An offline request: every committed position and every depth of the target's path has
    margin 5 unless `margins` ({output position: margin}) or `draft` ({(round, depth): margin})
    says otherwise (a round that accepted n tokens has depths 1..n of the drafter's)."""
    per_round, per_depth, position = [], [], 1
    for index, length in enumerate(lengths):
        per_round.append([(margins or {}).get(p, 5.0) for p in range(position, position + length)])
        per_depth.append([(draft or {}).get((index, d), 5.0) for d in range(1, length + 1)])
        position += length
    made = tokens if tokens is not None else list(range(1 + sum(lengths)))
    return OfflineRequest(made, list(lengths), (margins or {}).get(0, prefill), per_round, per_depth)


def test_histograms_count_rounds_by_acceptance_length():
    assert acc.histogram([1, 3, 1, 2]) == [2, 1, 1]
    assert acc.mean_length([2, 1, 1]) == pytest.approx(7 / 4)
    assert acc.add_histograms([[1], [0, 2, 1]]) == [1, 2, 1]
    assert acc.within([1, 1], [2, 1, 1]) and not acc.within([0, 0, 2], [2, 1, 1])
    assert acc.shown([19, 0, 2]) == "1:19 3:2"
    with pytest.raises(ValueError, match="got 0"):
        acc.histogram([0])


def test_the_margin_is_twice_the_measured_noise_and_never_below_the_floor():
    assert acc.auto_margin(0.091) == pytest.approx(0.182)
    assert acc.auto_margin(0.001) == acc.auto_margin(None) == acc.MIN_NEAR_TIE_MARGIN


def test_sglangs_meta_info_gives_the_histogram():
    # index k of spec_correct_drafts_histogram: rounds with k accepted drafts (+ the bonus)
    assert acc.server_histogram({"spec_correct_drafts_histogram": [20, 3, 0], "spec_verify_ct": 23}) == [20, 3]
    assert acc.server_histogram({"spec_correct_drafts_histogram": [23], "spec_verify_ct": 23}) == [23]
    assert acc.server_histogram({"completion_tokens": 24}) is None  # no speculation


def test_near_ties_are_the_committed_positions_and_path_depths_below_the_margin():
    request = offline([2, 3, 1], margins={0: 0.2, 4: 0.1, 6: 3.0}, draft={(1, 3): 0.3, (2, 1): 0.01})
    ties = request.near_ties(0.5)
    assert [(t.kind, t.round, t.position) for t in ties] == [
        ("target", 0, 0), ("target", 1, 4), ("draft", 1, 3), ("draft", 2, 1)]
    assert str(ties[1]) == "token 4 (round 1, target margin 0.100)"
    assert str(ties[2]) == "round 1 depth 3 (draft margin 0.300)"
    assert [t.position for t in request.near_ties(0.05)] == [1]


def test_equal_histogram_and_tokens_without_a_near_tie():
    request = offline([2, 3, 1])
    check = acc.check_request(0, request.tokens, [1, 1, 1], request, 0.5)
    assert check.verdict == Verdict.EQUAL
    row = check.row("ddtree-b16")
    assert row["server_rounds"] == row["offline_rounds"] == 3 and row["server_acceptance_length"] == 2.0


def test_a_different_histogram_without_a_near_tie_is_a_mismatch():
    request = offline([2, 3, 1])
    check = acc.check_request(3, request.tokens, [3], request, 0.5)
    assert check.verdict == Verdict.MISMATCH
    assert check.why == "acceptance 1:3 against the offline loop's 1:1 2:1 3:1 with no near-tie below 0.5"


def test_different_tokens_without_a_near_tie_are_a_mismatch_naming_the_token():
    request = offline([2, 2])
    tokens = list(request.tokens)
    tokens[3] = 99
    check = acc.check_request(0, tokens, [0, 2], request, 0.5)
    assert check.verdict == Verdict.MISMATCH and check.token_difference == 3
    assert "at token 3 (margin there 5.000) with no near-tie below 0.5" in check.why


def test_after_a_near_tie_only_the_rounds_before_it_must_hold():
    request = offline([3, 2, 1, 1], margins={5: 0.1})  # position 5: round 1
    tokens = request.tokens[:5] + [70, 71, 72]
    held = acc.check_request(0, tokens, [3, 0, 1], request, 0.5)  # the round of 3 is there; the rest differ
    assert held.verdict == Verdict.NEAR_TIE and held.near_ties[0].round == 1 and held.exact_rounds == 1
    assert "the 1 rounds before hold; histogram differs" in held.why
    lost = acc.check_request(0, tokens, [4], request, 0.5)  # the first round's 3 tokens were not accepted
    assert lost.verdict == Verdict.MISMATCH and "(3:1) are not all among the server's (1:4)" in lost.why
    early = acc.check_request(0, request.tokens[:2] + [9] * 6, [1, 1, 1], request, 0.5)
    assert early.verdict == Verdict.MISMATCH and "at token 2, before the first target near-tie at token 5" in early.why


def test_a_variant_fails_on_a_mismatch_or_a_mean_beyond_the_tolerance():
    one, two = offline([3, 3]), offline([2, 2], margins={0: 0.0})
    equal = acc.check_request(0, one.tokens, [0, 0, 2], one, 0.5)
    tied = acc.check_request(1, two.tokens, [0, 2], two, 0.5)
    good = acc.VariantCheck("ddtree-b16", [equal, tied], tolerance=0.5)
    assert good.problems == [] and good.summary()["acceptance_ok"]
    assert good.summary()["acceptance_equal"] == 1 and good.summary()["acceptance_near_tie"] == 1
    assert (good.summary()["rounds_held_exactly"], good.summary()["offline_rounds"]) == (2, 4)  # the tie is at the prefill
    assert good.server_acceptance == good.offline_acceptance == 2.5
    slower = acc.check_request(1, two.tokens, [4], two, 0.5)  # a near-tie from the prefill: anything may differ
    bad = acc.VariantCheck("ddtree-b16", [equal, slower], tolerance=0.5)
    assert bad.problems == ["ddtree-b16: acceptance length 1.667 in the server against 2.500 offline, "
                            "beyond the tolerance 0.5"]  # 10 tokens in 6 rounds, against 10 in 4
    assert bad.summary()["histogram_distance"] == pytest.approx(0.6667, abs=1e-4)


def test_a_draft_near_tie_excuses_the_rounds_from_it_on_but_never_other_tokens():
    request = offline([3, 2, 2], draft={(1, 2): 0.05})  # round 1 nearly drafted one token less
    held = acc.check_request(0, request.tokens, [1, 2, 1], request, 0.5)  # same 8 tokens, other rounds
    assert held.verdict == Verdict.NEAR_TIE
    assert held.why.startswith("near-ties at round 1 depth 2 (draft margin 0.050); the 1 rounds before hold")
    tokens = list(request.tokens)
    tokens[6] = 99
    changed = acc.check_request(0, tokens, [1, 2, 1], request, 0.5)
    assert changed.verdict == Verdict.MISMATCH and "at token 6, with no target near-tie" in changed.why
