"""Is the trained tiny target's greedy text degenerate? Byte statistics of its outputs on the
held-out prompts, beside the same statistics of the held-out text that follows each prompt.

A degenerate byte model repeats one byte or one short line, or emits mostly whitespace; a
drafter then "accepts" easily and DDTree's gains mean nothing. Four numbers per text:
distinct byte values, the longest run of one repeated byte, the share of whitespace bytes
(space, tab, newline), and the share of its 8-byte substrings that occur once (1.0: no
repeats; a loop of one short line scores low).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import mean
from typing import Sequence

WHITESPACE = frozenset(b" \t\n")
NGRAM = 8


@dataclass(frozen=True)
class TextStats:
    distinct_bytes: float
    longest_run: int
    whitespace_share: float
    unique_ngram_share: float

    def to_dict(self) -> dict:
        return asdict(self)


def _longest_run(ids: Sequence[int]) -> int:
    best = run = 0
    previous = None
    for value in ids:
        run = run + 1 if value == previous else 1
        previous = value
        best = max(best, run)
    return best


def text_stats(ids: Sequence[int]) -> TextStats:
    """The four numbers for one text (a list of byte values)."""
    grams = [tuple(ids[i: i + NGRAM]) for i in range(len(ids) - NGRAM + 1)]
    counts: dict[tuple[int, ...], int] = {}
    for gram in grams:
        counts[gram] = counts.get(gram, 0) + 1
    return TextStats(
        distinct_bytes=float(len(set(ids))),
        longest_run=_longest_run(ids),
        whitespace_share=sum(1 for v in ids if v in WHITESPACE) / max(1, len(ids)),
        unique_ngram_share=sum(1 for g in grams if counts[g] == 1) / max(1, len(grams)),
    )


def summarize(texts: Sequence[Sequence[int]]) -> TextStats:
    """Means over texts, except the longest run: the worst text's."""
    each = [text_stats(t) for t in texts]
    return TextStats(
        distinct_bytes=round(mean(s.distinct_bytes for s in each), 2),
        longest_run=max(s.longest_run for s in each),
        whitespace_share=round(mean(s.whitespace_share for s in each), 3),
        unique_ngram_share=round(mean(s.unique_ngram_share for s in each), 3),
    )


def greedy_outputs(target_dir: str, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (float32, the offline decode loop's AR)."""
    import torch

    from ddtree.decode import DecodeConfig, generate_autoregressive
    from ddtree.dflash_drafter import load_target

    target = load_target(target_dir, "cpu", torch.float32)
    config = DecodeConfig(max_new_tokens=new_tokens)
    return [generate_autoregressive(target, torch.tensor([list(p)]), config).new_token_ids for p in prompts]
