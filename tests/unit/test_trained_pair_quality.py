"""The trained tiny target writes text, not a loop: its greedy 64 bytes after each held-out prompt,
measured as ddtree.sglang.cpu.pair_quality measures them, stay close to the held-out text that
follows the same prompts (a degenerate model repeats a byte or a line, or emits whitespace, and
then any drafter "accepts" it). Figures: benchmarks/RESULTS.md, "Trained tiny pair"."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from ddtree.sglang.cpu import trained_pair  # noqa: E402
from ddtree.sglang.cpu.pair_quality import greedy_outputs, summarize, text_stats  # noqa: E402

pytestmark = pytest.mark.slow


def test_text_stats_see_loops_runs_and_whitespace():
    prose = list(b"def parse(text):\n\treturn [line.split() for line in text]\n")
    loop = list(b"x = 1\n" * 10)
    assert text_stats(loop).unique_ngram_share < 0.2 < 0.9 < text_stats(prose).unique_ngram_share
    assert text_stats(list(b"a" + b" " * 30 + b"b")).longest_run == 30
    assert text_stats(list(b"\t\t\n  ab")).whitespace_share == 5 / 7


def test_the_trained_targets_greedy_text_is_not_degenerate():
    items = [json.loads(line) for line in
             (trained_pair.COMMITTED / trained_pair.PROMPTS_NAME).read_text().splitlines()]
    outputs = greedy_outputs(str(trained_pair.COMMITTED / "target"), [i["input_ids"] for i in items], 64)
    model = summarize(outputs)
    held_out = summarize([i["continuation_ids"] for i in items])
    assert len({tuple(o) for o in outputs}) == len(outputs), "two prompts decode to the same bytes"
    # Measured (benchmarks/RESULTS.md): distinct bytes 20.1 against the held-out text's 25.6,
    # unique 8-grams 0.72 against 0.97 (a small model's greedy prose repeats some words),
    # whitespace 0.16 against 0.16, longest run 5 against 5. An 800-step target, half of whose
    # outputs looped ("the content the content") or ran tabs, had 15.2, 0.52, 0.24 and 60.
    assert model.whitespace_share <= held_out.whitespace_share + 0.1, (model, held_out)
    assert model.distinct_bytes >= 0.7 * held_out.distinct_bytes, (model, held_out)
    assert model.unique_ngram_share >= 0.6 * held_out.unique_ngram_share, (model, held_out)
    assert model.longest_run <= max(8, 2 * held_out.longest_run), (model, held_out)
