"""The recipe of the trained tiny pair: a byte-level Qwen3 target trained on the pinned stdlib
corpus, then a z-lab-layout DFlash drafter (`ddtree.dflash_model.DFlashDraftNet`, NeoX RoPE)
distilled on the target's own greedy text.

Everything here that computes is the recipe: changing it (comments and docstrings aside)
changes the recipe hash (ddtree.sglang.cpu.trained_pair), and the committed weights must then
be retrained. Fixed seeds and one thread make a run byte-for-byte repeatable on one machine
and torch build. About 9 CPU-minutes: the target 1600 steps of 8 x 256 bytes (0.22 CPU-s a
step), the drafter's data 32 x 256 greedy rollouts, then 1200 drafter steps.

Shapes (SGLang 0.5.23 serves them): the target has 4 layers and the drafter taps layers
[0, 1, 2]: DFlash captures "before layer k+1" for tap k (models/qwen3.py:793-805), so a tap
of the last layer cannot be served. Vocabulary: 256 byte values and the drafter's mask token.
The drafter is trained as it decodes: a window of real text, then the target's own greedy
continuation (a "rollout"); a block anchored anywhere in the first part of the rollout has
as context what decoding has after that many accepted tokens, the bonus is the target's next
token and the labels the target's greedy tokens after it (cross-entropy per block position,
weighted exp(-(k-1)/7) as in DFlash). On an earlier 800-step target, a drafter trained only
on blocks right after real text accepted 2.3 tokens a round (DFlash, held-out prompts), one
trained on rollouts 5.8.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from ddtree.dflash_model import DFlashConfig, DFlashCache, DFlashDraftNet
from ddtree.sglang.cpu.byte_corpus import Corpus

VOCAB = 257  # byte values 0..255 and the mask token
MASK_TOKEN = 256
# Part of the recipe (float sums split by thread differ). One thread: a second one spins in
# OpenMP waits on a busy machine (1.7 CPU-s a target step there, against 0.22 on one thread).
THREADS = 1
MAX_POSITIONS = 1024

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 128,
    "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
}
BLOCK_SIZE = 16
TAPS = [0, 1, 2]
DRAFTER_CONFIG = {
    # No `rope_is_neox_style` key, as in the published drafters: NeoX, SGLang's default
    # (models/dflash.py:265-269), and what DFlashDraftNet computes.
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 128,
    "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "block_size": BLOCK_SIZE, "num_target_layers": 4,
    "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": MASK_TOKEN},
}


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int
    lr: float
    warmup: int
    seed: int


TARGET_SCHEDULE = Schedule(steps=1600, batch=8, lr=3e-3, warmup=40, seed=1)
TARGET_SEQUENCE = 256
DRAFTER_SCHEDULE = Schedule(steps=1200, batch=16, lr=3e-3, warmup=30, seed=2)
DRAFTER_CONTEXT = (16, 192)  # real-text context lengths, drawn per rollout group
ROLLOUT = 48  # greedy tokens after each window; blocks are anchored anywhere in the first 33
ROLLOUT_GROUP = 256  # windows per group (one context length, one batched generation)
ROLLOUT_GROUPS = 32
DEPTH_DECAY = 7.0  # block position k weighs exp(-(k-1)/7)
WEIGHT_DECAY = 0.1
PROMPT_COUNT = 16
PROMPTS_NAME = "prompts.jsonl"
PROMPT_LENGTHS = (48, 160)
CONTINUATION_BYTES = 64  # of held-out text kept beside each prompt (what a person would write next)
PROMPT_SEED = 3

Log = Callable[[str], None]


def learning_rate(schedule: Schedule, step: int) -> float:
    """Linear warm-up, then cosine down to a tenth."""
    if step < schedule.warmup:
        return schedule.lr * (step + 1) / schedule.warmup
    progress = (step - schedule.warmup) / max(1, schedule.steps - schedule.warmup)
    return schedule.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def line_starts(text: torch.Tensor) -> torch.Tensor:
    """[n] int64 offsets right after each newline of a byte tensor."""
    return (text == ord("\n")).nonzero().squeeze(1) + 1


class Stream:
    """The training files as one byte tensor, with line starts (prompts begin on a line)."""

    def __init__(self, files: tuple[bytes, ...]):
        self.text = torch.frombuffer(bytearray(b"".join(files)), dtype=torch.uint8).long()  # [n]
        self.starts = line_starts(self.text)

    def windows(self, count: int, length: int, generator: torch.Generator, at_lines: bool) -> torch.Tensor:
        """[count, length] int64 windows at random offsets (or random line starts)."""
        if at_lines:
            usable = self.starts[self.starts < self.text.numel() - length]
            offsets = usable[torch.randint(0, usable.numel(), (count,), generator=generator)]
        else:
            offsets = torch.randint(0, self.text.numel() - length, (count,), generator=generator)
        return torch.stack([self.text[o: o + length] for o in offsets.tolist()])


class Progress:
    """A line at least every `every_s` seconds, and at the end."""

    def __init__(self, log: Log, what: str, total: int, every_s: float = 20.0):
        self.log, self.what, self.total, self.every_s = log, what, total, every_s
        self.start = self.last = time.monotonic()

    def step(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s or step == self.total - 1:
            self.last = now
            self.log(f"{self.what}: step {step + 1}/{self.total}, loss {loss:.3f}, {now - self.start:.0f} s")


def _optimizer(params, schedule: Schedule) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)


def new_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{k: v for k, v in TARGET_CONFIG.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    torch.manual_seed(TARGET_SCHEDULE.seed)
    return Qwen3ForCausalLM(config)


def fit(model: torch.nn.Module, schedule: Schedule, what: str, log: Log,
        batch_loss: Callable[[torch.Generator], torch.Tensor]) -> torch.nn.Module:
    """AdamW over `schedule`: each step draws a batch with the schedule's generator and descends
    its loss (gradients clipped to norm 1); returns the model in eval mode."""
    optimizer = _optimizer(model.parameters(), schedule)
    generator = torch.Generator().manual_seed(schedule.seed)
    progress = Progress(log, what, schedule.steps)
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(schedule, step)
        loss = batch_loss(generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        progress.step(step, loss.item())
    return model.eval()


def with_steps(schedule: Schedule, steps: int | None) -> Schedule:
    return schedule if steps is None else Schedule(**{**schedule.__dict__, "steps": steps})


def train_target(corpus: Corpus, log: Log, steps: int | None = None):
    """The byte-level target, trained from scratch (float32)."""
    stream = Stream(corpus.train)
    model = new_target().train()

    def batch_loss(generator: torch.Generator) -> torch.Tensor:
        batch = stream.windows(TARGET_SCHEDULE.batch, TARGET_SEQUENCE + 1, generator, at_lines=False)
        logits = model(batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    return fit(model, with_steps(TARGET_SCHEDULE, steps), "target", log, batch_loss)


@torch.no_grad()
def held_out_loss(model, corpus: Corpus, windows: int = 64) -> float:
    """Mean nats per byte on fixed windows of the held-out files."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    batch = Stream(corpus.held_out).windows(windows, TARGET_SEQUENCE + 1, generator, at_lines=False)
    logits = model(batch[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)))


@torch.no_grad()
def greedy_rollouts(model, context: torch.Tensor, tokens: int) -> torch.Tensor:
    """context [b, n] followed by the target's greedy tokens: [b, n + tokens]."""
    from ddtree.hf_target import HFTarget, new_dynamic_cache

    cache = {HFTarget(model).cache_keyword: new_dynamic_cache()}
    out = model(context, use_cache=True, **cache)
    chosen = [out.logits[:, -1].argmax(-1)]
    for _ in range(tokens - 1):
        out = model(chosen[-1].unsqueeze(1), use_cache=True, **cache)
        chosen.append(out.logits[:, -1].argmax(-1))
    return torch.cat([context, torch.stack(chosen, dim=1)], dim=1)


@torch.no_grad()
def tapped_hidden(model, tokens: torch.Tensor) -> torch.Tensor:
    """The drafter's context features of `tokens` [b, n]: the tapped layers' outputs [b, n, taps*H]
    (layer k's output is hidden_states[k + 1]), as DFlash captures them."""
    out = model(tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[k + 1] for k in TAPS], dim=-1)


def new_drafter() -> DFlashDraftNet:
    torch.manual_seed(DRAFTER_SCHEDULE.seed)
    config = DFlashConfig.from_dict(DRAFTER_CONFIG, "pair_training.DRAFTER_CONFIG")
    return DFlashDraftNet(config, target_hidden_size=TARGET_CONFIG["hidden_size"])


def drafter_loss(drafter: DFlashDraftNet, target, context: torch.Tensor, greedy: torch.Tensor,
                 hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted cross-entropy of the drafter's block against the target's greedy tokens.
    context [b, n]; greedy [b, BLOCK_SIZE] (greedy[:, 0] is the bonus); hidden [b, n, taps*H]."""
    batch, n = context.shape
    block = torch.full((batch, BLOCK_SIZE), MASK_TOKEN, dtype=torch.long)
    block[:, 0] = greedy[:, 0]
    noise = target.get_input_embeddings()(block)  # [b, BLOCK_SIZE, H]
    positions = torch.arange(n + BLOCK_SIZE)
    out = drafter(noise, hidden, positions, DFlashCache(drafter.cfg.num_layers))
    logits = target.get_output_embeddings()(out[:, 1:])  # [b, BLOCK_SIZE-1, V]
    per_position = F.cross_entropy(logits.reshape(-1, VOCAB), greedy[:, 1:].reshape(-1),
                                   reduction="none").view(batch, BLOCK_SIZE - 1)
    return (per_position * weights).sum(1).mean()


class Rollouts:
    """Windows of training text, each followed by ROLLOUT tokens of the target's own greedy
    continuation: `groups` tensors [ROLLOUT_GROUP, n + ROLLOUT], n drawn per group. A block
    anchored a tokens into a rollout has what decoding has after a accepted tokens: real text,
    then the target's own, as context; its bonus and labels are the target's next choices."""

    def __init__(self, target, corpus: Corpus, log: Log):
        generator = torch.Generator().manual_seed(DRAFTER_SCHEDULE.seed)
        stream = Stream(corpus.train)
        low, high = DRAFTER_CONTEXT
        self.groups = []
        for index in range(ROLLOUT_GROUPS):
            length = int(torch.randint(low, high + 1, (1,), generator=generator))
            context = stream.windows(ROLLOUT_GROUP, length, generator, at_lines=True)
            self.groups.append(greedy_rollouts(target, context, ROLLOUT))
            if index % 8 == 7:
                log(f"drafter data: {index + 1}/{ROLLOUT_GROUPS} groups of greedy rollouts")
        self.prompt_lengths = [g.shape[1] - ROLLOUT for g in self.groups]

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(context [size, n + a], block tokens [size, BLOCK_SIZE]): bonus then the labels."""
        group = int(torch.randint(0, len(self.groups), (1,), generator=generator))
        rows = torch.randperm(ROLLOUT_GROUP, generator=generator)[:size]
        anchor = int(torch.randint(0, ROLLOUT - BLOCK_SIZE + 1, (1,), generator=generator))
        end = self.prompt_lengths[group] + anchor
        tokens = self.groups[group][rows]
        return tokens[:, :end], tokens[:, end: end + BLOCK_SIZE]


def train_drafter(target, corpus: Corpus, log: Log, steps: int | None = None) -> DFlashDraftNet:
    """The drafter distilled on blocks anchored in the target's greedy rollouts (Rollouts)."""
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    rollouts = Rollouts(target, corpus, log)
    drafter = new_drafter().train()
    depth = torch.arange(BLOCK_SIZE - 1, dtype=torch.float32)
    weights = torch.exp(-depth / DEPTH_DECAY)
    weights = weights / weights.sum()

    def batch_loss(generator: torch.Generator) -> torch.Tensor:
        context, block = rollouts.batch(DRAFTER_SCHEDULE.batch, generator)
        return drafter_loss(drafter, target, context, block, tapped_hidden(target, context), weights)

    return fit(drafter, with_steps(DRAFTER_SCHEDULE, steps), "drafter", log, batch_loss)


def held_out_prompts(corpus: Corpus) -> list[dict]:
    """PROMPT_COUNT prompts, each from its own held-out file, starting on a line: the input ids,
    where they came from, and the held-out text that follows them."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    low, high = PROMPT_LENGTHS
    prompts = []
    files = [i for i, text in enumerate(corpus.held_out) if len(text) > 4 * (high + CONTINUATION_BYTES)]
    picked = torch.randperm(len(files), generator=generator)[:PROMPT_COUNT].tolist()
    for index in sorted(files[i] for i in picked):
        text = torch.frombuffer(bytearray(corpus.held_out[index]), dtype=torch.uint8).long()
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        starts = line_starts(text)
        starts = starts[starts < text.numel() - length - CONTINUATION_BYTES]
        offset = int(starts[int(torch.randint(0, starts.numel(), (1,), generator=generator))])
        prompts.append({
            "input_ids": text[offset: offset + length].tolist(),
            "source": f"{corpus.held_out_paths[index]}@{offset}",
            "continuation_ids": text[offset + length: offset + length + CONTINUATION_BYTES].tolist(),
        })
    return prompts


def write_models(folder: Path, target, drafter, prompts: list[dict]) -> None:
    """Both models in bfloat16 (what the server serves; the offline loops upcast exactly) and the
    prompts, as JSON lines."""
    from safetensors.torch import save_file

    target_dir, drafter_dir = folder / "target", folder / "drafter"
    for path in (target_dir, drafter_dir):
        path.mkdir(parents=True, exist_ok=True)
    target_state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in target.state_dict().items()}
    save_file(target_state, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    (target_dir / "config.json").write_text(json.dumps({**TARGET_CONFIG, "torch_dtype": "bfloat16"}, indent=1) + "\n")
    drafter_state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(drafter_state, str(drafter_dir / "model.safetensors"), metadata={"format": "pt"})
    (drafter_dir / "config.json").write_text(json.dumps({**DRAFTER_CONFIG, "torch_dtype": "bfloat16"}, indent=1) + "\n")
    (folder / PROMPTS_NAME).write_text("".join(json.dumps(p) + "\n" for p in prompts))


def with_threads(run: Callable[[], object]) -> object:
    """Run with the recipe's thread count, then restore the caller's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return run()
    finally:
        torch.set_num_threads(previous)
