"""A tiny random-weight Qwen3 target, a matching DFlash drafter and token-id prompts, on
disk, for the CPU test server (no model hub, no tokenizer: serve with --skip-tokenizer-init).

    python -m ddtree.sglang.cpu.tiny_models DIR             # DIR/target, DIR/drafter, DIR/prompts.jsonl
    python -m ddtree.sglang.cpu.tiny_models --trained DIR   # the same, trained (ddtree.sglang.cpu.trained_pair)

Both print the host inventory's `models:` entry. The random pair proves losslessness; its
drafter accepts little. The trained pair (a byte-level target trained on the Python standard
library and a DFlash drafter distilled from it, NeoX RoPE) shows what DDTree gains over DFlash.

Shapes chosen for SGLang 0.5.23's DFlash:
- 3 target layers: DFlash captures the hidden state *before* layer k+1 for target layer k
  (models/qwen3.py:793-805), so target_layer_ids [0, 1] need a layer 2.
- weights are served in bfloat16 (DFlash casts the drafter's input to it,
  model_executor/model_runner.py:1772); init range 0.5 keeps the target's next-token
  distributions peaked, so greedy decoding is far from ties.
- the drafter's RoPE is not NeoX-style: that keeps SGLang's drafter on its torch RoPE path
  instead of the fused Triton table_qk_norm_rope kernel (models/dflash.py:283-289, 383),
  which Triton's interpreter runs too slowly to serve with.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

VOCAB = 256
BLOCK_SIZE = 6
PROMPT_COUNT = 8


def target_config() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 1024, "initializer_range": 0.5, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    }


def write_target(folder: Path, seed: int = 0) -> Path:
    from ddtree.sglang.cpu.torchvision_ops import import_torchvision

    import_torchvision()  # transformers imports it; in the CPU server's environment it needs help
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{k: v for k, v in target_config().items() if k not in ("architectures", "model_type")})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(str(folder))
    return folder


def write_drafter(folder: Path, seed: int = 0) -> Path:
    from ddtree.lossless import save_tiny_dflash_drafter, tiny_dflash_config

    config = tiny_dflash_config(VOCAB, block_size=BLOCK_SIZE, rope_is_neox_style=False, torch_dtype="bfloat16")
    return save_tiny_dflash_drafter(folder, config, target_hidden=64, seed=seed)


def write_prompts(path: Path, count: int = PROMPT_COUNT, seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    lines = []
    for index in range(count):
        length = 2 + index % 6  # 2..7 tokens: requests of different lengths in one batch
        ids = torch.randint(0, VOCAB - 1, (length,), generator=generator).tolist()  # VOCAB-1 is the mask token
        lines.append(json.dumps({"input_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_tiny_models(folder: Path, seed: int = 0) -> dict[str, str]:
    """Writes all three; returns the host inventory's `models:` entry for them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_target(folder / "target", seed)
    write_drafter(folder / "drafter", seed)
    write_prompts(folder / "prompts.jsonl", seed=seed)
    return {"target": str(folder / "target"), "drafter": str(folder / "drafter"), "block_size": BLOCK_SIZE,
            "prompts": str(folder / "prompts.jsonl")}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--trained":
        from ddtree.sglang.cpu.trained_pair import TrainedPairError, write_trained_pair

        try:
            print(json.dumps(write_trained_pair(Path(args[1]))))
        except TrainedPairError as err:
            print(f"tiny_models: {err}", file=sys.stderr)
            return 3
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m ddtree.sglang.cpu.tiny_models [--trained] DIR", file=sys.stderr)
        return 2
    print(json.dumps(write_tiny_models(Path(args[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
