"""A DFlash block-diffusion drafter in plain torch (the z-lab Qwen3-based layout).

Each layer attends, without a causal mask, from the block's noise tokens to the keys of the
committed context (target hidden states, fused by `fc` + `hidden_norm`) and of the block
itself. Context keys persist in a small per-layer cache across rounds; the block's keys are
dropped after every call. Shapes follow the weights of the published checkpoints:
`layers.{i}.self_attn.{q,k,v,o}_proj`, `{q,k}_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
`{input,post_attention}_layernorm`, `norm`, `fc`, `hidden_norm`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F


class DFlashConfigError(ValueError):
    """The drafter's config.json lacks a field or asks for something we do not implement."""


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    attention_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer: window or None for full attention
    # NeoX RoPE rotates (x_i, x_i+d/2); GPT-J style (False) rotates (x_2i, x_2i+1). The net
    # computes NeoX; the loader turns a GPT-J drafter's q/k weights into the NeoX layout.
    rope_is_neox_style: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> "DFlashConfig":
        def need(key: str, source: Mapping[str, Any] = raw, label: str = "") -> Any:
            if key not in source or source[key] is None:
                raise DFlashConfigError(f"{where}: missing {label}{key!r}")
            return source[key]

        dflash = raw.get("dflash_config")
        if not isinstance(dflash, Mapping):
            raise DFlashConfigError(f"{where}: not a DFlash drafter config (no 'dflash_config' section)")
        layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        target_ids = dflash.get("target_layer_ids")
        if target_ids is None:
            target_ids = default_target_layer_ids(int(need("num_target_layers")), layers)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise DFlashConfigError(f"{where}: rope type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise DFlashConfigError(f"{where}: missing 'rope_theta'")
        layer_types = raw.get("layer_types") or ["full_attention"] * layers
        window = raw.get("sliding_window")
        windows = tuple(int(window) if kind == "sliding_attention" and window else None for kind in layer_types)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            block_size=int(need("block_size")),
            target_layer_ids=tuple(int(i) for i in target_ids),
            mask_token_id=int(need("mask_token_id", dflash, "dflash_config.")),
            attention_bias=bool(raw.get("attention_bias", False)),
            sliding_windows=windows,
            # as SGLang reads it (srt/models/dflash.py:265-267)
            rope_is_neox_style=bool(raw.get("rope_is_neox_style", raw.get("is_neox_style", True))),
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread taps from layer 1 to layer L-3 (the DFlash default when not configured)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n] int64 -> cos, sin [n, head_dim] (the half-split rotary layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [n, head_dim/2]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.sliding_windows[index] if index < len(cfg.sliding_windows) else None
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.self_attn.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.self_attn.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.self_attn.o_proj = nn.Linear(cfg.num_heads * d, h, bias=bias)
        self.self_attn.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [b, q, H] block (noise) stream (b > 1 only when training)
        context: torch.Tensor,  # [b, c, H] fused target features of the new context rows
        cos: torch.Tensor,  # [c + q, head_dim] for positions of the new context rows then the block
        sin: torch.Tensor,  # [c + q, head_dim]
        positions: torch.Tensor,  # [c + q] int64
        cache: "DFlashCache",
        layer: int,
    ) -> torch.Tensor:
        cfg, attn = self.cfg, self.self_attn
        batch, q_len, c_len = hidden.shape[0], hidden.shape[1], context.shape[1]
        residual = hidden
        x = self.input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(batch, q_len, cfg.num_heads, cfg.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, x], dim=1)  # [b, c+q, H]
        k = attn.k_norm(attn.k_proj(kv_in).view(batch, c_len + q_len, cfg.num_kv_heads, cfg.head_dim)).transpose(1, 2)
        v = attn.v_proj(kv_in).view(batch, c_len + q_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos[-q_len:] + rotate_half(q) * sin[-q_len:]
        k = k * cos + rotate_half(k) * sin
        k, v, key_positions = cache.extend(layer, k, v, positions)
        mask = None
        if self.window is not None:
            distance = positions[-q_len:].unsqueeze(1) - key_positions.unsqueeze(0)  # [q, T]
            mask = distance.abs() < self.window
        groups = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)  # [b, heads, q, d]
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, q_len, cfg.num_heads * cfg.head_dim))
        hidden = residual + out
        x = self.post_attention_layernorm(hidden)
        return hidden + self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))


class DFlashCache:
    """Per-layer context keys/values `[b, kv_heads, T, d]` and their positions `[T]` (shared by
    the batch: b > 1 only when training, every row at the same positions)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [T] int64, shared by the layers

    def length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def extend(
        self,
        layer: int,
        k: torch.Tensor,  # [b, kv_heads, c + q, d] keys of the new context rows, then the block
        v: torch.Tensor,  # [b, kv_heads, c + q, d]
        positions: torch.Tensor,  # [c + q] int64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append k/v to layer `layer` and return (keys, values [b, kv_heads, T + c + q, d],
        key positions [T + c + q]). The block's rows are stored too: `DFlashDraftNet.forward`
        crops them off after the last layer and only then records the context positions."""
        old_k, old_v = self.keys[layer], self.values[layer]
        full_k = k if old_k is None else torch.cat([old_k, k], dim=2)
        full_v = v if old_v is None else torch.cat([old_v, v], dim=2)
        self.keys[layer], self.values[layer] = full_k, full_v
        key_positions = positions if self.positions is None else torch.cat([self.positions, positions])
        return full_k, full_v, key_positions

    def commit_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions])

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]
        if self.positions is not None:
            self.positions = self.positions[:length]


class DFlashDraftNet(nn.Module):
    def __init__(self, cfg: DFlashConfig, target_hidden_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        features = len(cfg.target_layer_ids) * (target_hidden_size or cfg.hidden_size)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        noise_embedding: torch.Tensor,  # [b, q, H] embeddings of [bonus, mask, ..., mask]
        target_hidden: torch.Tensor,  # [b, c, L*H] target features of the not-yet-cached context
        positions: Sequence[int] | torch.Tensor,  # c + q positions: the new context rows, then the block
        cache: DFlashCache,
    ) -> torch.Tensor:
        """Returns the final hidden states of the block [b, q, H]; the cache gains the c rows.
        Decoding runs b = 1; training runs a batch of blocks at the same positions."""
        positions = torch.as_tensor(positions, dtype=torch.long, device=noise_embedding.device)
        c_len = target_hidden.shape[1]
        past = cache.length()
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, noise_embedding.dtype)
        hidden = noise_embedding
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, context, cos, sin, positions, cache, index)
        cache.crop(past + c_len)  # drop the block's rows, keep the new context rows
        cache.commit_positions(positions[:c_len])
        return self.norm(hidden)
