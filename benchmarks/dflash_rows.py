"""Rows from a real DFlash drafter forward pass: the `dflash-tiny` row family.

The project's DFlash drafter (`ddtree.dflash_model`, the layout z-lab checkpoints use) drafts
one block over the tiny Llama test target (`ddtree.lossless.build_tiny_target`), at the
vocabulary asked for: the target reads an 8-token prompt and hands the drafter its hidden
states, its own next token is the block's root, and the drafter's [D, V] logits (through the
target's lm_head, as in DFlash) are what a DDTree round builds its tree from.

Both models have seeded random weights (no trained drafter can be fetched here), so the rows
have the shape of a random projection, not of a trained drafter: Gaussian-like logits with a
standard deviation of about 4 and one favourite token shared by most positions, each row's top
token at p ~ 0.1-0.25, trees 3-5 levels deep at budget 1024 and V = 151936. Its copy at
T = 0.5 stands in for a confident drafter (top p ~ 0.5-0.99, trees 5-15 levels deep).

Generated on one intra-op thread, so the same arguments give the same rows on one machine
whatever the caller's thread count (another CPU's kernels may round the matmuls differently).
Needs `transformers` (the test extra), imported only when the family is asked for.
"""
from __future__ import annotations

import torch

PROMPT_TOKENS = 8


def dflash_block_logits(g: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    """[depth, vocab] float32: one drafted block's logits (block size depth + 1); the models'
    seed and the prompt come from `g`."""
    if depth == 0:
        return torch.empty(0, vocab)
    try:
        import transformers  # noqa: F401  (the tiny target is a transformers Llama)
    except ImportError:
        raise ValueError("row family 'dflash-tiny' needs transformers (pip install -e '.[test]')") from None
    from ddtree.dflash_drafter import DFlashDrafter
    from ddtree.dflash_model import DFlashConfig, DFlashDraftNet
    from ddtree.drafters import DraftRequest
    from ddtree.lossless import build_tiny_target, tiny_dflash_config

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = build_tiny_target(seed=seed, vocab_size=vocab, dtype=torch.float32)
        config = DFlashConfig.from_dict(tiny_dflash_config(vocab_size=vocab, block_size=depth + 1), "dflash-tiny")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            net = DFlashDraftNet(config, target_hidden_size=target.hidden_size).eval()
        drafter = DFlashDrafter(net, target)
        with torch.inference_mode():
            positions = torch.arange(PROMPT_TOKENS).unsqueeze(0)
            seen = target.forward(prompt, positions, target.new_cache(), hidden_layer_ids=drafter.target_layer_ids)
            root = int(seen.logits[-1].argmax())
            return drafter.draft(DraftRequest(prompt, seen.hidden, root, PROMPT_TOKENS))  # [depth, V] float32
    finally:
        torch.set_num_threads(threads)
