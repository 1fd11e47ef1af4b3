"""A request's acceptance inside the SGLang server against the offline loop's on the same
prompt, method, budget and T=0 (`ddtree.decode` with `DecodeConfig(record_margins=True)`).

The server's side is SGLang's own per-request counter, `meta_info.spec_correct_drafts_histogram`
(sglang 0.5.23 `srt/managers/tokenizer_manager.py:3193-3201`): entry k counts the request's
verify rounds that committed k drafted tokens besides the bonus, accumulated by the scheduler
from the accept lengths the worker returned (`srt/managers/scheduler_components/
batch_result_processor.py:782-787, 830-836`, `srt/managers/schedule_batch.py:1566-1572`). Here a
histogram is always that list: `histogram[k]` = rounds that accepted k + 1 tokens (k drafts and
the bonus), which is also the offline loop's acceptance length k + 1. SGLang keeps no per-round
order, so a request's rounds are compared as a multiset, together with its tokens.

A near-tie is a place where the offline loop's choice had less than `margin` (logits) to
spare (`ddtree.margins`), so bf16 server arithmetic may rightly choose otherwise, and every
round from then on may differ:
- target: a position whose choice a round committed (the prefill's token, then per round the
  root and every accepted node) where the target's top-1 minus top-2 logit is below `margin`:
  the server may commit another token there;
- draft: a depth of the target's own path in a round where the drafter's choice (DFlash's
  greedy token, or DDTree's admission of the node into the tree) was within `margin` of going
  the other way: the server may accept one more or fewer token in that round (same tokens).
Per request:
- no near-tie: the server's histogram and tokens equal the offline loop's (`equal`), else
  `mismatch`;
- near-ties: the offline rounds before the first one must all be among the server's (a
  sub-multiset) and the tokens before the first target near-tie equal (`near-tie`, the
  near-ties named), else `mismatch`.
Per variant: no `mismatch`, and the mean acceptance length over all rounds of all requests
within `tolerance` of the offline mean (near-ties move it either way).

Standard library only: the host side runs it after the offline loop, the operator side reads
its rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

# The near-tie margin, unless given: twice the largest difference measured between the server's
# and the offline target's top-2 gaps on the same text (MarginNoise), at least MIN_NEAR_TIE_MARGIN.
AUTO_MARGIN_FACTOR = 2.0
MIN_NEAR_TIE_MARGIN = 0.02  # logits
DEFAULT_ACCEPTANCE_TOLERANCE = 0.5  # tokens per round, absolute (as decode-bench's tau)
SERVER_HISTOGRAM_KEY = "spec_correct_drafts_histogram"  # SGLang's meta_info field


class Verdict:
    EQUAL = "equal"
    NEAR_TIE = "near-tie"
    MISMATCH = "mismatch"


# ----------------------------------------------------------------------------- histograms


def histogram(lengths: Iterable[int]) -> list[int]:
    """Acceptance lengths (>= 1) of rounds -> `histogram[k]` = rounds of length k + 1."""
    counts: list[int] = []
    for length in lengths:
        if length < 1:
            raise ValueError(f"an acceptance length is >= 1 (the bonus), got {length}")
        counts += [0] * (length - len(counts))
        counts[length - 1] += 1
    return counts


def add_histograms(histograms: Iterable[Sequence[int]]) -> list[int]:
    total: list[int] = []
    for counts in histograms:
        total += [0] * (len(counts) - len(total))
        for index, count in enumerate(counts):
            total[index] += count
    return total


def rounds_of(counts: Sequence[int]) -> int:
    return sum(counts)


def mean_length(counts: Sequence[int]) -> float | None:
    """Mean acceptance length (root included) over the rounds a histogram counts."""
    rounds = sum(counts)
    return sum((k + 1) * c for k, c in enumerate(counts)) / rounds if rounds else None


def server_histogram(meta: dict[str, Any]) -> list[int] | None:
    """A /generate reply's meta_info -> its histogram; None when the server kept none (no
    speculation: SGLang sends it once a request had a verify round)."""
    counts = meta.get(SERVER_HISTOGRAM_KEY)
    if isinstance(counts, list) and counts and all(isinstance(c, int) and c >= 0 for c in counts):
        return _trimmed(counts)
    return None


def _trimmed(counts: Sequence[int]) -> list[int]:
    out = list(counts)
    while out and out[-1] == 0:
        out.pop()
    return out


def within(smaller: Sequence[int], larger: Sequence[int]) -> bool:
    """Every round `smaller` counts is also counted by `larger` (sub-multiset)."""
    return all(count <= (larger[k] if k < len(larger) else 0) for k, count in enumerate(smaller))


def shown(counts: Sequence[int]) -> str:
    """`1:19 2:2`: length:rounds pairs, the form a person reads in a reason."""
    return " ".join(f"{k + 1}:{c}" for k, c in enumerate(counts) if c) or "none"


def auto_margin(measured_max: float | None) -> float:
    """The near-tie margin from the largest measured server-vs-offline gap difference."""
    return max(MIN_NEAR_TIE_MARGIN, AUTO_MARGIN_FACTOR * (measured_max or 0.0))


# ----------------------------------------------------------------------------- the offline side


TARGET, DRAFT = "target", "draft"


@dataclass(frozen=True)
class NearTie:
    kind: str  # TARGET or DRAFT
    round: int  # the first offline round whose outcome it can change (0 for the prefill's token)
    position: int  # TARGET: index of the output token chosen there; DRAFT: the depth in the round
    margin: float  # what the offline choice had to spare (logits)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "round": self.round, "position": self.position, "margin": round(self.margin, 4)}

    def __str__(self) -> str:
        if self.kind == TARGET:
            return f"token {self.position} (round {self.round}, target margin {self.margin:.3f})"
        return f"round {self.round} depth {self.position} (draft margin {self.margin:.3f})"


@dataclass(frozen=True)
class OfflineRequest:
    """What the offline loop did for one request (a `ddtree.decode.DecodeResult`, T=0, margins kept)."""

    tokens: list[int]  # new tokens, cut at max_new_tokens
    acceptance_lengths: list[int]  # per round, root included
    prefill_margin: float
    verify_margins: list[list[float]]  # per round, one per committed token (the target's)
    draft_margins: list[list[float]] = field(default_factory=list)  # per round, one per depth of the target's path
    forced: int = 0  # the first `forced` tokens followed the server's text (DecodeConfig.forced_tokens)

    @classmethod
    def from_result(cls, result: Any, forced: int = 0) -> "OfflineRequest":
        if result.verify_margins is None or result.prefill_margin is None:
            raise ValueError("the offline run kept no margins (DecodeConfig(record_margins=True))")
        return cls(list(result.new_token_ids), list(result.acceptance_lengths), float(result.prefill_margin),
                   [list(m) for m in result.verify_margins], [list(m) for m in result.draft_margins or []], forced)

    def position_margins(self) -> list[tuple[int, float]]:
        """(round, margin) per output position: the prefill's token is position 0, round 0."""
        out = [(0, self.prefill_margin)]
        for index, margins in enumerate(self.verify_margins):
            out += [(index, m) for m in margins]
        return out

    def near_ties(self, margin: float) -> list[NearTie]:
        """Every near-tie, in round order (a round's target ones first). Where the loop followed
        the server's text, the target's choices were the server's: no target near-tie there."""
        target = [NearTie(TARGET, r, position, m) for position, (r, m) in enumerate(self.position_margins())
                  if m < margin and position >= self.forced]
        draft = [NearTie(DRAFT, r, depth, m) for r, margins in enumerate(self.draft_margins)
                 for depth, m in enumerate(margins, start=1) if m < margin]
        return sorted(target + draft, key=lambda t: (t.round, t.kind != TARGET, t.position))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- one request


@dataclass
class RequestCheck:
    prompt: int
    verdict: str
    why: str
    server: list[int]  # histogram
    offline: list[int]
    near_ties: list[NearTie] = field(default_factory=list)
    token_difference: int | None = None  # first output token where the server and the offline loop differ

    @property
    def exact_rounds(self) -> int:
        """Offline rounds held exactly: all of an `equal` request's, the rounds before the first
        near-tie of a `near-tie` one, none of a `mismatch`."""
        if self.verdict == Verdict.EQUAL:
            return rounds_of(self.offline)
        return self.near_ties[0].round if self.verdict == Verdict.NEAR_TIE else 0

    def row(self, variant: str) -> dict[str, Any]:
        server_mean, offline_mean = mean_length(self.server), mean_length(self.offline)
        return {
            "variant": variant, "prompt": self.prompt, "verdict": self.verdict, "why": self.why,
            "server_rounds": rounds_of(self.server), "offline_rounds": rounds_of(self.offline),
            "server_acceptance_length": None if server_mean is None else round(server_mean, 4),
            "offline_acceptance_length": None if offline_mean is None else round(offline_mean, 4),
            "server_histogram": self.server, "offline_histogram": self.offline,
            "near_ties": [t.to_dict() for t in self.near_ties], "token_difference": self.token_difference,
            "exact_rounds": self.exact_rounds,
        }


def check_request(prompt: int, server_tokens: Sequence[int], server_counts: Sequence[int],
                  offline: OfflineRequest, margin: float) -> RequestCheck:
    server_counts = _trimmed(server_counts)
    offline_counts = histogram(offline.acceptance_lengths)
    differs = first_difference(list(server_tokens), offline.tokens)
    ties = offline.near_ties(margin)
    margins = offline.position_margins()

    def made(verdict: str, why: str) -> RequestCheck:
        return RequestCheck(prompt, verdict, why, server_counts, offline_counts, ties, differs)

    if not ties:
        if differs is not None:
            at = f" (margin there {margins[differs][1]:.3f})" if differs < len(margins) else ""
            return made(Verdict.MISMATCH, f"tokens differ from the offline loop's at token {differs}{at} "
                                          f"with no near-tie below {margin:g}")
        if server_counts != offline_counts:
            return made(Verdict.MISMATCH, f"acceptance {shown(server_counts)} against the offline loop's "
                                          f"{shown(offline_counts)} with no near-tie below {margin:g}")
        return made(Verdict.EQUAL, "histogram and tokens equal the offline loop's")
    first = ties[0]
    named = ", ".join(str(t) for t in ties[:3]) + (f" and {len(ties) - 3} more" if len(ties) > 3 else "")
    first_token = next((t for t in ties if t.kind == TARGET), None)  # a draft near-tie keeps the tokens
    if differs is not None and (first_token is None or differs < first_token.position):
        where = f"before the first target near-tie at {first_token}" if first_token else "with no target near-tie"
        return made(Verdict.MISMATCH, f"tokens differ from the offline loop's at token {differs}, {where}")
    before = histogram(offline.acceptance_lengths[: first.round])
    if not within(before, server_counts):
        return made(Verdict.MISMATCH, f"the offline rounds before the first near-tie ({shown(before)}) are not "
                                      f"all among the server's ({shown(server_counts)}); near-ties: {named}")
    same = "equal" if server_counts == offline_counts else "differs"
    return made(Verdict.NEAR_TIE, f"near-ties at {named}; the {first.round} rounds before hold; histogram {same}")


# ----------------------------------------------------------------------------- one variant


@dataclass
class VariantCheck:
    variant: str
    requests: list[RequestCheck]
    tolerance: float

    @property
    def server_histogram(self) -> list[int]:
        return add_histograms(r.server for r in self.requests)

    @property
    def offline_histogram(self) -> list[int]:
        return add_histograms(r.offline for r in self.requests)

    @property
    def server_acceptance(self) -> float | None:
        return mean_length(self.server_histogram)

    @property
    def offline_acceptance(self) -> float | None:
        return mean_length(self.offline_histogram)

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.requests)

    @property
    def problems(self) -> list[str]:
        found = [f"{self.variant}: prompt {r.prompt}: {r.why}" for r in self.requests if r.verdict == Verdict.MISMATCH]
        server, offline = self.server_acceptance, self.offline_acceptance
        if server is not None and offline is not None and abs(server - offline) > self.tolerance:
            found.append(f"{self.variant}: acceptance length {server:.3f} in the server against {offline:.3f} "
                         f"offline, beyond the tolerance {self.tolerance:g}")
        return found

    def summary(self) -> dict[str, Any]:
        server, offline = self.server_acceptance, self.offline_acceptance
        return {
            "offline_acceptance_length": None if offline is None else round(offline, 4),
            "acceptance_equal": self.count(Verdict.EQUAL), "acceptance_near_tie": self.count(Verdict.NEAR_TIE),
            "acceptance_mismatch": self.count(Verdict.MISMATCH),
            "rounds_held_exactly": sum(r.exact_rounds for r in self.requests),
            "offline_rounds": rounds_of(self.offline_histogram),
            "acceptance_histogram": self.server_histogram, "offline_acceptance_histogram": self.offline_histogram,
            "histogram_distance": histogram_distance(self.server_histogram, self.offline_histogram),
            "acceptance_tolerance": self.tolerance,
            "acceptance_ok": not self.problems,
        }


def histogram_distance(a: Sequence[int], b: Sequence[int]) -> float | None:
    """Total variation distance between two histograms' shares (0: the same shape, 1: disjoint)."""
    total_a, total_b = sum(a), sum(b)
    if not total_a or not total_b:
        return None
    size = max(len(a), len(b))
    share = [(a[k] if k < len(a) else 0) / total_a - (b[k] if k < len(b) else 0) / total_b for k in range(size)]
    return round(sum(abs(s) for s in share) / 2, 4)
