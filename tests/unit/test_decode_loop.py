"""The decode loop's parts and records: verify inputs, KV compaction, stop tokens, limits,
the reference record shape, and refusals of drafters that cannot serve the target."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.build import build_ddtree_tree_from_logits  # noqa: E402
from ddtree.decode import (  # noqa: E402
    STAGE_ORDER,
    DecodeConfig,
    DecodeMethod,
    compile_tree_inputs,
    generate_autoregressive,
    generate_dflash,
    generate_ddtree,
    method_key,
)
from ddtree.drafters import DrafterMismatchError, NoisyTargetDrafter, check_drafter  # noqa: E402
from ddtree.kvcache import UnsupportedCacheError, crop_cache, keep_cache_rows  # noqa: E402
from ddtree.lossless import TINY_VOCAB, build_tiny_target, prompt_set  # noqa: E402
from ddtree.verify import build_verify_inputs  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(seed=0)


def golden_tree():
    return build_ddtree_tree_from_logits(torch.tensor([[5.0, 4.0, 1.0], [4.0, 3.0, 2.0], [3.0, 2.0, 1.0]]), 5)


def test_tree_inputs_for_the_golden_tree():
    tree = golden_tree()  # parents [-1, 0, 1, 2, 0, 1], tokens [0, 0, 0, 1, 1], depths [1, 2, 3, 1, 2]
    inputs = compile_tree_inputs(7, tree, 10, torch.float32, torch.device("cpu"))
    assert inputs.input_ids.tolist() == [[7, 0, 0, 0, 1, 1]]
    assert inputs.position_ids.tolist() == [[10, 11, 12, 13, 11, 12]]
    mask = inputs.attention_mask
    assert mask.shape == (1, 1, 6, 16) and mask.dtype == torch.float32
    assert (mask[0, 0, :, :10] == 0).all()  # every tree row sees the whole committed context
    visible = (mask[0, 0, :, 10:] == 0).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    assert (mask[0, 0, :, 10:][mask[0, 0, :, 10:] != 0] == torch.finfo(torch.float32).min).all()


def test_tree_inputs_equal_the_core_batched_verify_inputs():
    """The loop's single-request fast path builds what the core's batched builder builds."""
    generator = torch.Generator().manual_seed(3)
    for budget in (0, 3, 17, 64, 300):  # 300: past BITSET_MAX_NODES, the tensor-built mask
        tree = build_ddtree_tree_from_logits(torch.randn(7, 40, generator=generator), budget)
        ours = compile_tree_inputs(9, tree, 21, torch.float64, torch.device("cpu"))
        core = build_verify_inputs([tree], torch.tensor([9]), torch.tensor([21]), width=tree.num_nodes + 1)
        assert torch.equal(ours.input_ids, core.input_ids)
        assert torch.equal(ours.position_ids, core.positions)
        assert torch.equal(ours.attention_mask, core.additive_attention_mask(torch.tensor([21]), 21, torch.float64))


def _cache_with_rows(target, rows):
    cache = target.new_cache()
    ids = torch.arange(rows).unsqueeze(0) % TINY_VOCAB
    target.forward(ids, torch.arange(rows).unsqueeze(0), cache)
    return cache


def test_keep_cache_rows_moves_the_accepted_rows_in_place_and_crops(target):
    cache = _cache_with_rows(target, 12)
    before = [layer.keys.clone() for layer in cache.layers]
    keep_cache_rows(cache, 5, torch.tensor([0, 2, 6]))
    assert cache.get_seq_length() == 8
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys[:, :, :5], old[:, :, :5])
        assert torch.equal(layer.keys[:, :, 5:], old[:, :, [5, 7, 11]])


def test_keep_cache_rows_names_an_unknown_cache_type():
    class OddCache:
        def get_seq_length(self):
            return 3

    with pytest.raises(UnsupportedCacheError, match="cannot compact a OddCache"):
        keep_cache_rows(OddCache(), 1, torch.tensor([0]))


def test_crop_cache_keeps_a_prefix_and_refuses_growing(target):
    cache = _cache_with_rows(target, 6)
    crop_cache(cache, 6)  # no-op, never crop(0) (which some versions read as "keep nothing")
    assert cache.get_seq_length() == 6
    crop_cache(cache, 4)
    assert cache.get_seq_length() == 4
    with pytest.raises(ValueError, match=r"length must be in \[0, 4\], got 5"):
        crop_cache(cache, 5)


def test_records_have_the_reference_run_shape(target):
    prompt = prompt_set(1, 6, TINY_VOCAB, seed=2)[0]
    drafter = NoisyTargetDrafter(target, block_size=8, noise=0.3)
    config = DecodeConfig(max_new_tokens=20, save_round_trees=True)
    result = generate_ddtree(target, drafter, prompt, config, budget=16)
    record = result.to_namespace()
    assert isinstance(record, SimpleNamespace)
    for name in ("output_ids", "num_input_tokens", "num_output_tokens", "time_to_first_token",
                 "time_per_output_token", "acceptance_lengths", "decode_rounds", "stage_times",
                 "round_timestamps", "round_trees"):
        assert hasattr(record, name), name
    assert record.output_ids.shape == (1, 26) and torch.equal(record.output_ids[:, :6], prompt)
    assert record.num_input_tokens == 6 and record.num_output_tokens == 20
    assert record.decode_rounds == len(record.acceptance_lengths) == len(record.round_timestamps)
    assert tuple(record.stage_times) == STAGE_ORDER
    assert all(seconds >= 0 for seconds in record.stage_times.values())
    # Tokens: the prefill's first, then each round commits its accepted nodes (bonus of the last).
    assert 1 + sum(record.acceptance_lengths) >= 20
    assert len(record.round_trees) == record.decode_rounds
    first = record.round_trees[0]
    assert first["accepted_indices"][0] == 0 and len(first["accepted_indices"]) == record.acceptance_lengths[0]
    assert len(first["tree"]["parents"]) == len(first["tree"]["node_token_ids"]) + 1 <= 17
    assert method_key(DecodeMethod.DDTREE, 16) == "ddtree_tb16"
    assert method_key(DecodeMethod.AUTOREGRESSIVE) == "baseline"


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_stop_tokens_end_every_method_at_the_same_token(target, method):
    prompt = prompt_set(1, 6, TINY_VOCAB, seed=4)[0]
    free = generate_autoregressive(target, prompt, DecodeConfig(max_new_tokens=30)).new_token_ids
    stop = free[7]
    cut = free.index(stop) + 1
    config = DecodeConfig(max_new_tokens=30, stop_token_ids=[stop])
    drafter = NoisyTargetDrafter(target, block_size=8, noise=0.2)
    run = {
        "ar": lambda: generate_autoregressive(target, prompt, config),
        "dflash": lambda: generate_dflash(target, drafter, prompt, config),
        "ddtree": lambda: generate_ddtree(target, drafter, prompt, config, budget=32),
    }[method]
    result = run()
    assert result.new_token_ids == free[:cut]
    assert result.num_output_tokens == cut


def test_budget_zero_and_single_token_limits(target):
    prompt = prompt_set(1, 4, TINY_VOCAB, seed=5)[0]
    expected = generate_autoregressive(target, prompt, DecodeConfig(max_new_tokens=9)).new_token_ids
    drafter = NoisyTargetDrafter(target, block_size=4, noise=0.0)
    zero = generate_ddtree(target, drafter, prompt, DecodeConfig(max_new_tokens=9), budget=0)
    assert zero.new_token_ids == expected and set(zero.acceptance_lengths) == {1}
    one = generate_ddtree(target, drafter, prompt, DecodeConfig(max_new_tokens=1), budget=8)
    assert one.new_token_ids == expected[:1] and one.decode_rounds == 0


def test_noise_free_drafter_is_accepted_whole(target):
    prompt = prompt_set(1, 5, TINY_VOCAB, seed=6)[0]
    drafter = NoisyTargetDrafter(target, block_size=6, noise=0.0)
    result = generate_dflash(target, drafter, prompt, DecodeConfig(max_new_tokens=25))
    assert result.acceptance_lengths[:3] == [6, 6, 6]  # the target's own greedy path: all D + root


def test_bad_arguments_name_the_value(target):
    prompt = prompt_set(1, 4, TINY_VOCAB, seed=5)[0]
    drafter = NoisyTargetDrafter(target, block_size=4, noise=0.1)
    with pytest.raises(ValueError, match="budget must be >= 0, got -2"):
        generate_ddtree(target, drafter, prompt, DecodeConfig(max_new_tokens=4), budget=-2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an int, got 2.5"):
        DecodeConfig(max_new_tokens=2.5)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -0.5"):
        DecodeConfig(max_new_tokens=3, temperature=-0.5)
    with pytest.raises(ValueError, match=r"input_ids must have shape \[1, n >= 1\], got \[4\]"):
        generate_autoregressive(target, prompt[0], DecodeConfig(max_new_tokens=3))


def test_a_drafter_with_another_vocabulary_is_refused(target):
    other = build_tiny_target(seed=0, vocab_size=TINY_VOCAB + 8)
    drafter = NoisyTargetDrafter(other, block_size=4, noise=0.1)
    prompt = prompt_set(1, 4, TINY_VOCAB, seed=5)[0]
    with pytest.raises(DrafterMismatchError, match=r"drafter vocabulary \(104\) differs from the target's \(96\)"):
        generate_ddtree(target, drafter, prompt, DecodeConfig(max_new_tokens=4), budget=4)
    with pytest.raises(DrafterMismatchError, match=r"drafter vocabulary \(104\)"):
        generate_dflash(target, drafter, prompt, DecodeConfig(max_new_tokens=4))


def test_an_unsupported_block_size_is_refused(target):
    drafter = NoisyTargetDrafter(target, block_size=8, noise=0.1)
    with pytest.raises(DrafterMismatchError, match="block size 16 is not supported by the drafter"):
        check_drafter(drafter, target, block_size=16)
    with pytest.raises(DrafterMismatchError, match="block size must be >= 2"):
        NoisyTargetDrafter(target, block_size=1, noise=0.1)


def _tiny_mistral(window: int):
    from transformers import MistralConfig, MistralForCausalLM

    from ddtree.hf_target import HFTarget

    config = MistralConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                           initializer_range=0.5, attn_implementation="sdpa")
    torch.manual_seed(0)
    return HFTarget(MistralForCausalLM(config).to(torch.float64).eval())


def test_a_sliding_window_target_is_refused_once_the_window_can_bind(target):
    """The tree mask is passed as is, so the model's window would not apply: measured, a
    window of 4 broke losslessness at the second new token. Within the window nothing is
    masked, so a window the run cannot reach is fine."""
    assert target.sliding_window is None  # a full-attention Llama
    prompt = prompt_set(1, 6, TINY_VOCAB, seed=2)[0]
    narrow = _tiny_mistral(window=4)
    assert narrow.sliding_window == 4
    drafter = NoisyTargetDrafter(narrow, block_size=4, noise=0.0)
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 4\).*= 19 exceeds it"):
        generate_ddtree(narrow, drafter, prompt, DecodeConfig(max_new_tokens=4), budget=8)
    wide = _tiny_mistral(window=64)
    result = generate_ddtree(wide, NoisyTargetDrafter(wide, block_size=4, noise=0.5), prompt,
                             DecodeConfig(max_new_tokens=6), budget=8)
    assert torch.equal(result.output_ids, generate_autoregressive(wide, prompt, DecodeConfig(max_new_tokens=6)).output_ids)
