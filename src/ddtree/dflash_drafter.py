"""The published DFlash drafters (z-lab/*-DFlash-*) behind the `Drafter` protocol.

`load_dflash_drafter(path_or_id, target)` reads `config.json` and `*.safetensors` from a local
folder or, for a Hugging Face id, from the local HF cache only (no download on an eval host),
checks the drafter against the target and returns a `DFlashDrafter`. Each round the drafter
embeds `[bonus, mask * D]` with the target's embedding, runs its layers over the new context
features, and the target's `lm_head` turns the last D hidden states into logits `[D, V]`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ddtree.dflash_model import DFlashCache, DFlashConfig, DFlashConfigError, DFlashDraftNet
from ddtree.drafters import DraftRequest, DrafterMismatchError, check_drafter
from ddtree.hf_target import HFTarget


class ModelPathError(FileNotFoundError):
    """A model path or id that resolves to nothing usable; the message names it."""


def resolve_model_dir(name: str) -> Path:
    """A local folder, or the snapshot of a Hugging Face id already in the local cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelPathError(f"model path {name}: not a folder")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception as err:  # noqa: BLE001 - any hub failure means "not in the cache"
            raise ModelPathError(
                f"model {name}: no such folder, and not in the local Hugging Face cache ({type(err).__name__})"
            ) from None
    raise ModelPathError(f"model path {name}: no such folder")


class DFlashDrafter:
    """`Drafter` over a `DFlashDraftNet` sharing the target's embedding and lm_head."""

    def __init__(self, net: DFlashDraftNet, target: HFTarget):
        self.net = net
        self.cfg = net.cfg
        self.block_size = net.cfg.block_size
        self.vocab_size = net.cfg.vocab_size
        self.target_layer_ids = tuple(net.cfg.target_layer_ids)
        self.mask_token_id = net.cfg.mask_token_id
        self._target = target
        self._cache = DFlashCache(net.cfg.num_layers)

    def begin(self, target: HFTarget) -> None:
        self._target = target
        self._cache = DFlashCache(self.cfg.num_layers)

    @torch.inference_mode()
    def draft(self, request: DraftRequest) -> torch.Tensor:
        if request.new_target_hidden is None:
            raise ValueError("a DFlash drafter needs the target's hidden states of the committed tokens")
        target, start = self._target, request.start
        n_new = int(request.new_target_hidden.shape[1])
        if self._cache.length() != start - n_new:
            raise ValueError(f"drafter context holds {self._cache.length()} rows, expected {start - n_new}")
        device = target.device
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = request.bonus_token
        positions = torch.arange(start - n_new, start + self.block_size, device=device)
        hidden = self.net(target.embed(block), request.new_target_hidden, positions, self._cache)
        logits = target.lm_head(hidden[0, 1:])  # [D, V]
        return logits.float()


def gptj_rope_as_neox(state: dict[str, torch.Tensor], config: DFlashConfig) -> dict[str, torch.Tensor]:
    """A GPT-J-style RoPE drafter's weights in the layout the net's NeoX RoPE computes it with.

    GPT-J rotates each pair (x_2i, x_2i+1), NeoX each (y_i, y_i+d/2), at the same angle i. With
    y = x[0, 2, 4, ..., 1, 3, 5, ...] the two rotations agree, and q and k meet only in their dot
    product, so permuting the head dimensions of q_proj/k_proj's outputs (and of q_norm/k_norm,
    whose RMS is blind to the order) makes the net compute the GPT-J drafter exactly."""
    d = config.head_dim
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # [d]
    out = dict(state)
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            heads = tensor.shape[0] // d
            out[name] = tensor.reshape(heads, d, *tensor.shape[1:])[:, order].reshape(tensor.shape)
        elif name.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight")):
            out[name] = tensor[order]
    return out


def build_dflash_drafter(config: DFlashConfig, state: dict[str, torch.Tensor], target: HFTarget, where: str) -> DFlashDrafter:
    """Check `config`/`state` against `target` and assemble the drafter (on the target's device)."""
    net = DFlashDraftNet(config, target_hidden_size=target.hidden_size)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    expected = net.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DFlashConfigError(
            f"{where}: weights do not match a DFlash drafter: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DrafterMismatchError(
                f"{where}: {name} has shape {list(tensor.shape)}, expected {list(expected[name].shape)} "
                f"for a target with hidden size {target.hidden_size}"
            )
    if not config.rope_is_neox_style:
        state = gptj_rope_as_neox(state, config)
    net.load_state_dict(state)
    net = net.to(device=target.device, dtype=target.dtype).eval()
    drafter = DFlashDrafter(net, target)
    check_drafter(drafter, target)
    return drafter


def load_dflash_drafter(name: str, target: HFTarget, block_size: int | None = None) -> DFlashDrafter:
    """Load a z-lab DFlash drafter for `target`. `block_size` is the drafter's own, or a
    shorter block (>= 2) it then drafts with, as SGLang's `--speculative-dflash-block-size`
    serves it (the bonus and fewer mask tokens; a budget below the drafter's block needs one)."""
    folder = resolve_model_dir(name)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelPathError(f"model path {name}: no config.json in {folder}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DFlashConfigError(f"{config_path}: not JSON: {err}") from None
    config = DFlashConfig.from_dict(raw, str(config_path))
    if block_size is not None and block_size != config.block_size:
        if not 2 <= block_size < config.block_size:
            raise DrafterMismatchError(
                f"block size {block_size} is not supported by {name} (trained for blocks of {config.block_size}); "
                f"a shorter block of at least 2 is"
            )
        config = dataclasses.replace(config, block_size=block_size)
    if config.vocab_size != target.vocab_size:
        raise DrafterMismatchError(
            f"drafter {name} has vocabulary {config.vocab_size}, the target has {target.vocab_size}"
        )
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelPathError(f"model path {name}: no *.safetensors weights in {folder}")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return build_dflash_drafter(config, state, target, str(folder))


def load_target(name: str, device: str | torch.device, dtype: torch.dtype = torch.bfloat16) -> HFTarget:
    """A causal LM target from a local folder or the local HF cache, with sdpa attention
    (the tree verify passes a 4-D additive mask, which flash-attention kernels ignore)."""
    folder = resolve_model_dir(name)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return HFTarget(model.to(device).eval())
