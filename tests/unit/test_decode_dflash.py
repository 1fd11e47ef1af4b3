"""The DFlash drafter adapter on a tiny randomly initialised drafter saved like a z-lab one
(config.json + safetensors). Real z-lab weights are not available here: these tests cover
loading, validation, shapes and losslessness through the loops, not draft quality."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ddtree.decode import DecodeConfig, generate_autoregressive, generate_dflash, generate_ddtree  # noqa: E402
from ddtree.dflash_drafter import ModelPathError, load_dflash_drafter, resolve_model_dir  # noqa: E402
from ddtree.dflash_model import DFlashConfig, DFlashConfigError, default_target_layer_ids  # noqa: E402
from ddtree.drafters import DraftRequest, DrafterMismatchError  # noqa: E402
from ddtree.lossless import (  # noqa: E402
    TINY_VOCAB,
    build_tiny_target,
    prompt_set,
    save_tiny_dflash_drafter,
    tiny_dflash_config,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(seed=0)


def drafter_config(**overrides):
    return tiny_dflash_config(**overrides)


def save_drafter(folder: Path, config: dict, target_hidden: int = 64) -> Path:
    return save_tiny_dflash_drafter(folder, config, target_hidden=target_hidden)


@pytest.mark.slow
def test_loaded_drafter_returns_block_logits_and_keeps_its_context(tmp_path, target):
    drafter = load_dflash_drafter(str(save_drafter(tmp_path / "d", drafter_config())), target)
    assert (drafter.block_size, drafter.vocab_size, drafter.target_layer_ids) == (6, TINY_VOCAB, (0, 1))
    drafter.begin(target)
    hidden = torch.randn(1, 7, 128, dtype=target.dtype)
    logits = drafter.draft(DraftRequest(torch.zeros(1, 7, dtype=torch.long), hidden, 3, 7))
    assert logits.shape == (5, TINY_VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # Next round: 2 newly committed rows on top of the 7 cached ones.
    logits2 = drafter.draft(DraftRequest(torch.zeros(1, 2, dtype=torch.long), hidden[:, :2], 4, 9))
    assert logits2.shape == (5, TINY_VOCAB) and not torch.equal(logits, logits2)
    with pytest.raises(ValueError, match="drafter context holds 9 rows, expected 8"):
        drafter.draft(DraftRequest(torch.zeros(1, 2, dtype=torch.long), hidden[:, :2], 4, 10))


@pytest.mark.slow
def test_loops_with_a_dflash_drafter_are_lossless(tmp_path, target):
    drafter = load_dflash_drafter(str(save_drafter(tmp_path / "d", drafter_config())), target, block_size=6)
    for prompt in prompt_set(2, 6, TINY_VOCAB, seed=9):
        config = DecodeConfig(max_new_tokens=16)
        expected = generate_autoregressive(target, prompt, config).new_token_ids
        assert generate_dflash(target, drafter, prompt, config).new_token_ids == expected
        for budget in (4, 32):
            assert generate_ddtree(target, drafter, prompt, config, budget=budget).new_token_ids == expected


def test_a_missing_model_path_is_named(tmp_path, target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelPathError, match=r"model path .*/nowhere: no such folder"):
        load_dflash_drafter(str(tmp_path / "nowhere"), target)
    with pytest.raises(ModelPathError, match="model z-lab/Not-There: no such folder, and not in the local Hugging Face cache"):
        resolve_model_dir("z-lab/Not-There")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="no config.json in"):
        load_dflash_drafter(str(tmp_path / "empty"), target)


def test_an_unsupported_block_size_is_refused(tmp_path, target):
    folder = save_drafter(tmp_path / "d", drafter_config())
    with pytest.raises(DrafterMismatchError, match="block size 16 is not supported by .* \\(trained for blocks of 6\\)"):
        load_dflash_drafter(str(folder), target, block_size=16)
    with pytest.raises(DrafterMismatchError, match="block size 1 is not supported"):
        load_dflash_drafter(str(folder), target, block_size=1)


def test_a_shorter_block_drafts_fewer_positions_as_sglangs_block_size_option_serves_it(tmp_path, target):
    folder = save_drafter(tmp_path / "d", drafter_config())
    drafter = load_dflash_drafter(str(folder), target, block_size=3)
    assert drafter.block_size == 3
    result = generate_ddtree(target, drafter, torch.tensor([[1, 2, 3]]), DecodeConfig(max_new_tokens=8), budget=2)
    assert result.new_token_ids == generate_autoregressive(target, torch.tensor([[1, 2, 3]]),
                                                          DecodeConfig(max_new_tokens=8)).new_token_ids
    assert max(result.acceptance_lengths) <= 3


def test_a_drafter_with_another_vocabulary_is_refused(tmp_path, target):
    folder = save_drafter(tmp_path / "d", drafter_config(vocab_size=TINY_VOCAB * 2))
    with pytest.raises(DrafterMismatchError, match=r"has vocabulary 192, the target has 96"):
        load_dflash_drafter(str(folder), target)


def test_a_drafter_for_another_hidden_size_is_refused(tmp_path, target):
    folder = save_drafter(tmp_path / "d", drafter_config(), target_hidden=32)
    with pytest.raises(DrafterMismatchError, match=r"fc.weight has shape \[64, 64\], expected \[64, 128\]"):
        load_dflash_drafter(str(folder), target)


def test_a_drafter_reading_layers_the_target_lacks_is_refused(tmp_path, target):
    config = drafter_config(dflash_config={"target_layer_ids": [0, 5], "mask_token_id": 1})
    with pytest.raises(DrafterMismatchError, match="reads target layer 5, but the target has 2 layers"):
        load_dflash_drafter(str(save_drafter(tmp_path / "d", config)), target)


def test_configs_that_are_not_dflash_drafters_are_refused():
    with pytest.raises(DFlashConfigError, match="not a DFlash drafter config"):
        DFlashConfig.from_dict({"hidden_size": 8}, "cfg.json")
    with pytest.raises(DFlashConfigError, match="cfg.json: missing dflash_config.'mask_token_id'"):
        DFlashConfig.from_dict(drafter_config(dflash_config={"target_layer_ids": [0]}), "cfg.json")
    with pytest.raises(DFlashConfigError, match="rope type 'yarn' is not supported"):
        DFlashConfig.from_dict(drafter_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "cfg.json")


def test_default_target_layers_spread_like_the_reference():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_a_gptj_rope_drafter_is_computed_as_sglang_computes_it(tmp_path):
    """SGLang honours `rope_is_neox_style: false` (models/dflash.py:265-277); the loader turns such
    a drafter's q/k weights into the layout of the net's NeoX RoPE: the attention scores of the
    loaded weights with NeoX RoPE equal those of the original weights with GPT-J RoPE."""
    from ddtree.dflash_drafter import gptj_rope_as_neox
    from ddtree.dflash_model import DFlashConfig, rope_cos_sin, rotate_half

    raw = {**tiny_dflash_config(), "rope_is_neox_style": False}
    config = DFlashConfig.from_dict(raw, "config.json")
    assert not config.rope_is_neox_style and DFlashConfig.from_dict(tiny_dflash_config(), "c").rope_is_neox_style
    d, heads, hidden = config.head_dim, config.num_heads, config.hidden_size
    generator = torch.Generator().manual_seed(0)
    state = {"layers.0.self_attn.q_proj.weight": torch.randn(heads * d, hidden, generator=generator),
             "layers.0.self_attn.q_norm.weight": torch.rand(d, generator=generator) + 0.5}
    moved = gptj_rope_as_neox(state, config)
    x = torch.randn(5, hidden, generator=generator)
    positions = torch.arange(3, 8)

    def normed(weight, norm):  # [5, heads, d]
        q = (x @ weight.T).view(5, heads, d)
        return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * norm

    cos, sin = rope_cos_sin(positions, d, config.rope_theta, torch.float32)  # [5, d] half-split
    neox = normed(moved["layers.0.self_attn.q_proj.weight"], moved["layers.0.self_attn.q_norm.weight"])
    neox = neox * cos[:, None] + rotate_half(neox) * sin[:, None]
    plain = normed(state["layers.0.self_attn.q_proj.weight"], state["layers.0.self_attn.q_norm.weight"])
    angle_cos, angle_sin = cos[:, None, : d // 2], sin[:, None, : d // 2]
    even, odd = plain[..., 0::2], plain[..., 1::2]  # GPT-J: rotate each (x_2i, x_2i+1)
    gptj = torch.stack([even * angle_cos - odd * angle_sin, odd * angle_cos + even * angle_sin], dim=-1).flatten(-2)
    scores = lambda q: torch.einsum("ahd,bhd->hab", q, q)  # noqa: E731 - q against itself at every position pair
    assert torch.allclose(scores(neox), scores(gptj), atol=1e-4)
    assert not torch.allclose(scores(normed(state["layers.0.self_attn.q_proj.weight"],
                                            state["layers.0.self_attn.q_norm.weight"]) * cos[:, None]
                                     + rotate_half(plain) * sin[:, None]), scores(gptj), atol=1e-2)
