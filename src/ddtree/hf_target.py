"""A thin adapter over a Hugging Face causal LM: the one way the decode loops call the target.

It passes explicit `position_ids`, an optional 4-D additive mask `[1, 1, n, past + n]` and a
cache, and returns float logits plus (when asked) the hidden states of chosen layers. The
cache keyword is `cache` in transformers 5.x and `past_key_values` before; we pick the one
the model's `forward` declares so neither version warns. Every transformers import of the
decode path lives here or in `ddtree.lossless` / `ddtree.dflash_drafter`, inside functions, so
`import ddtree` and the smoke stages never need it.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch


class TargetOutput(NamedTuple):
    logits: torch.Tensor  # [n, V] float32 (or the model's float64)
    hidden: torch.Tensor | None  # [1, n, len(layer_ids) * H] or None when not asked


def transformers_version() -> str | None:
    """The installed transformers version, or None when it cannot be imported (stages skip)."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer saved with a target model (a local folder: never downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def new_dynamic_cache() -> Any:
    from transformers import DynamicCache  # lazy: ddtree imports without transformers

    return DynamicCache()


def _sliding_window(config: Any) -> int | None:
    """The attention window of a target that limits some layer to one (Mistral, Gemma-2/3,
    gpt-oss), else None. Qwen2/3 carry a `sliding_window` that `use_sliding_window` turns off."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None


class HFTarget:
    """Wraps `model` (e.g. `LlamaForCausalLM`, `Qwen3ForCausalLM`) in eval mode."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size: int = int(text_config.vocab_size)
        self.num_layers: int = int(text_config.num_hidden_layers)
        self.hidden_size: int = int(text_config.hidden_size)
        self.sliding_window: int | None = _sliding_window(text_config)

    @property
    def cache_keyword(self) -> str:
        """The model's keyword for the KV cache (`cache` in newer transformers)."""
        return self._cache_kw

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_cache(self) -> Any:
        return new_dynamic_cache()

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n] int64
        position_ids: torch.Tensor,  # [1, n] int64
        cache: Any,
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, past + n] additive, model dtype
        hidden_layer_ids: Sequence[int] | None = None,
        last_only: bool = False,
    ) -> TargetOutput:
        kwargs: dict[str, Any] = {
            "position_ids": position_ids,
            self._cache_kw: cache,
            "use_cache": True,
        }
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if hidden_layer_ids:
            kwargs["output_hidden_states"] = True
        if last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids, **kwargs)
        hidden = None
        if hidden_layer_ids:
            # hidden_states[0] is the embedding output; layer i's output is hidden_states[i + 1].
            hidden = torch.cat([out.hidden_states[i + 1] for i in hidden_layer_ids], dim=-1)
        logits = out.logits[0]
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return TargetOutput(logits=logits, hidden=hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [1, n] -> [1, n, H]
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        return self.model.get_output_embeddings()(hidden)
