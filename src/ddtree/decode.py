"""Model-agnostic decode loops: autoregressive, DFlash (linear verify) and DDTree (tree verify).

All three run one request over a Hugging Face causal LM target (`HFTarget`) and return a
`DecodeResult` shaped like one entry of the reference's saved runs (`acceptance_lengths`,
`decode_rounds`, `num_output_tokens`, `time_per_output_token`, `stage_times`, ...), so the
same metrics code reads ours and theirs.

One round of DDTree, top to bottom:
  draft        drafter -> logits [D, V] for the positions after the bonus token
  tree_build   best-first tree under the budget (ddtree.build)
  tree_compile token ids, positions start + depth, and the additive mask: every committed
               row visible, tree rows visible only to their descendants
  verify       one target forward over the N+1 tree tokens on top of the KV cache
  commit       walk the tree with the target's choices, keep the accepted KV rows in place,
               the target's choice at the last accepted node becomes the next bonus token
Every committed token is the target's own choice (argmax at T=0, a sample from
softmax(logits / T) otherwise), so the output is the target's, exactly at T=0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ddtree.build import BuildMethod, build_ddtree_tree_from_logits
from ddtree.commit import commit_round
from ddtree.drafters import DraftRequest, Drafter, check_drafter
from ddtree.hf_target import HFTarget
from ddtree.host_tensors import long_tensor
from ddtree.inputs import check_budget
from ddtree.kvcache import crop_cache, keep_cache_rows
from ddtree.margins import chain_draft_margins, top2_margins, tree_draft_margins
from ddtree.tree import DraftTree, hidden_columns
from ddtree.verify import follow_verified_tree

STAGE_ORDER: tuple[str, ...] = ("draft", "tree_build", "tree_compile", "verify", "commit")


class DecodeMethod(str, Enum):
    """The method keys the reference uses in its run files (DDTree adds `_tb<budget>`)."""

    AUTOREGRESSIVE = "baseline"
    DFLASH = "dflash"
    DDTREE = "ddtree"


DDTREE_KEY_PREFIX = "ddtree_tb"  # + the budget: the reference's DDTree method keys


def method_key(method: DecodeMethod, budget: int | None = None) -> str:
    """`baseline`, `dflash`, `ddtree_tb64`: the keys of a reference run's `responses` items."""
    if method is DecodeMethod.DDTREE:
        if budget is None:
            raise ValueError("a DDTree method key needs its budget")
        return f"{DDTREE_KEY_PREFIX}{budget}"
    return method.value


@dataclass
class DecodeConfig:
    max_new_tokens: int
    temperature: float = 0.0
    stop_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # drives sampling at T > 0 (device of the target)
    save_round_trees: bool = False
    # Keep, per round, how close the target's and the drafter's choices came to going otherwise
    # (DecodeResult.verify_margins / draft_margins, ddtree.margins): where other arithmetic (a
    # bf16 server against this loop, ddtree_ops.hostside.acceptance) may rightly differ.
    record_margins: bool = False
    # Follow these tokens instead of the target's own choices, as far as they go (T=0 only):
    # what this drafter and tree accept on a given text, e.g. a server's output, where the
    # target's near-ties under other arithmetic must not move the text. The target still runs
    # (its hidden states feed the drafter); past the end of the list it chooses as usual.
    forced_tokens: Sequence[int] | None = None
    # Where stage times are read from: wall time by default; `time.process_time` on a shared
    # CPU, where other processes' load must not count. Synchronised with the GPU either way.
    timer: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.forced_tokens is not None and self.temperature != 0.0:
            raise ValueError(f"forced_tokens follow a text at T=0, got temperature {self.temperature}")


@dataclass
class DecodeResult:
    """One request's outcome, with the reference run file's per-method fields."""

    output_ids: torch.Tensor  # [1, num_input_tokens + num_output_tokens] int64, CPU
    num_input_tokens: int
    num_output_tokens: int
    time_to_first_token: float  # seconds: the prefill
    time_per_output_token: float  # seconds: decode time (after the drafter's prefill) / tokens
    acceptance_lengths: list[int]  # per round: accepted nodes, root included
    decode_rounds: int
    stage_times: dict[str, float]  # seconds per stage, summed over rounds
    round_timestamps: list[float] = field(default_factory=list)  # seconds since decode start
    round_trees: list[dict[str, Any]] | None = None
    # With DecodeConfig.record_margins (ddtree.margins, logits units): the target's at the
    # prefill, then per round one per committed token (root first, then each accepted node);
    # the drafter's per round, one per depth 1 .. min(accepted, D) of the target's path.
    prefill_margin: float | None = None
    verify_margins: list[list[float]] | None = None
    draft_margins: list[list[float]] | None = None

    @property
    def new_token_ids(self) -> list[int]:
        return self.output_ids[0, self.num_input_tokens :].tolist()

    def to_namespace(self) -> SimpleNamespace:
        """The reference's record type (`types.SimpleNamespace`), e.g. to `torch.save` a run."""
        return SimpleNamespace(**{name: getattr(self, name) for name in self.__dataclass_fields__})


def choose_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's decoding rule. logits [n, V] -> [n] int64 (one independent choice per row)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


class _Clock:
    """perf_counter that first waits for queued GPU work, so stage times are real."""

    def __init__(self, device: torch.device, timer: Callable[[], float] = time.perf_counter):
        self._sync = device.type == "cuda"
        self._timer = timer

    def __call__(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return self._timer()


class TreeInputs(NamedTuple):
    input_ids: torch.Tensor  # [1, N+1] int64: root (bonus) then node tokens in pop order
    position_ids: torch.Tensor  # [1, N+1] int64: start + depth
    attention_mask: torch.Tensor  # [1, 1, N+1, past + N+1] additive, target dtype


def compile_tree_inputs(
    root_token: int,
    tree: DraftTree,
    start: int,  # position of the root; also the number of committed rows in the cache
    dtype: torch.dtype,
    device: torch.device,
) -> TreeInputs:
    """The verify forward's inputs: every tree row sees all committed rows and its ancestors."""
    n = len(tree.parents)
    # From the tree's host lists, one tensor each: a round's overhead is mostly per-op cost.
    input_ids = long_tensor([root_token] + tree.node_token_ids_list, device).view(1, n)
    position_ids = long_tensor([start] + [start + depth for depth in tree.node_depths_list], device).view(1, n)
    mask = torch.zeros((n, start + n), dtype=dtype, device=device)
    mask.narrow(1, start, n).masked_fill_(hidden_columns(tree).to(device), torch.finfo(dtype).min)
    return TreeInputs(input_ids, position_ids, mask.view(1, 1, n, start + n))


def _rows_kept(hidden: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """hidden [1, N+1, F] -> [1, K, F], the accepted tree rows (a view when they are a prefix,
    as on a greedy chain)."""
    if keep == list(range(len(keep))):
        return hidden[:, : len(keep)]
    return hidden.index_select(1, long_tensor(keep, hidden.device))


# --------------------------------------------------------------------------- the shared loop


class _Request:
    """Per-request state shared by the three loops: committed tokens, clock, records."""

    def __init__(self, target: HFTarget, input_ids: torch.Tensor, config: DecodeConfig, stages: Sequence[str]):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must have shape [1, n >= 1], got {list(input_ids.shape)}")
        self.target = target
        self.config = config
        self.device = target.device
        self.clock = _Clock(self.device, config.timer)
        self.prompt = input_ids.to(self.device)
        self.num_input = int(input_ids.shape[1])
        self.generated: list[int] = []  # committed tokens, the pending bonus last
        self.stage_times = {name: 0.0 for name in stages}
        self.acceptance_lengths: list[int] = []
        self.round_timestamps: list[float] = []
        self.round_trees: list[dict[str, Any]] | None = [] if config.save_round_trees else None
        self.prefill_margin: float | None = None
        self.verify_margins: list[list[float]] | None = [] if config.record_margins else None
        self.draft_margins: list[list[float]] | None = [] if config.record_margins else None
        self.stops = set(int(t) for t in config.stop_token_ids)
        self._stop_checked = 0  # generated[:_stop_checked] holds no stop token
        self.cache = target.new_cache()
        self.time_to_first_token = 0.0
        self.decode_start = 0.0

    @property
    def start(self) -> int:
        """Position of the bonus token (= committed rows in the target cache)."""
        return self.num_input + len(self.generated) - 1

    def choose(self, logits: torch.Tensor, depths: Sequence[int] | None = None) -> list[int]:
        """The target's choice per row; `depths[i]`: row i chooses the token that many places after
        the next one to commit (default: i; a tree's node depths), which forced_tokens decide."""
        chosen = choose_tokens(logits, self.config.temperature, self.config.generator).tolist()
        forced = self.config.forced_tokens
        if forced is None:
            return chosen
        ahead = len(self.generated)
        depths = range(len(chosen)) if depths is None else depths
        return [int(forced[ahead + d]) if ahead + d < len(forced) else c for d, c in zip(depths, chosen)]

    def prefill(self, hidden_layer_ids: Sequence[int] = ()) -> torch.Tensor | None:
        began = self.clock()
        positions = torch.arange(self.num_input, device=self.device).unsqueeze(0)
        out = self.target.forward(self.prompt, positions, self.cache, hidden_layer_ids=hidden_layer_ids,
                                  last_only=True)  # logits of the last row only: [1, V], not [n, V]
        self.generated.append(self.choose(out.logits[-1:])[0])
        if self.verify_margins is not None:
            self.prefill_margin = top2_margins(out.logits[-1:])[0]
        self.time_to_first_token = self.clock() - began
        self.decode_start = self.clock()
        return out.hidden

    def done(self) -> bool:
        """Stop at the length limit or once a stop token was committed (the bonus counts)."""
        fresh = self.generated[self._stop_checked :]
        self._stop_checked = len(self.generated)
        if any(token in self.stops for token in fresh):
            return True
        # The reference loops while start < max_length, i.e. one round more once it already
        # holds max_new_tokens tokens; that round's tokens are cut anyway, so we skip it.
        return len(self.generated) >= self.config.max_new_tokens

    @property
    def records_margins(self) -> bool:
        return self.verify_margins is not None

    def end_round(self, accepted: int, committed_logits: torch.Tensor | None = None,
                  draft_margins: Callable[[], list[float]] | None = None) -> None:
        """`committed_logits` [accepted, V]: the target's rows whose choices the round committed;
        `draft_margins`: the drafter's margins of the round (called only when they are kept)."""
        if self.records_margins and committed_logits is not None:
            self.verify_margins.append(top2_margins(committed_logits))
            self.draft_margins.append(draft_margins() if draft_margins is not None else [])
        self.acceptance_lengths.append(accepted)
        self.round_timestamps.append(self.clock() - self.decode_start)

    def result(self) -> DecodeResult:
        tokens = self.generated[: self.config.max_new_tokens]
        for i, token in enumerate(tokens):
            if token in self.stops:
                tokens = tokens[: i + 1]
                break
        decode_time = self.clock() - self.decode_start
        output_ids = torch.cat([self.prompt.cpu(), torch.tensor([tokens], dtype=torch.long)], dim=1)
        return DecodeResult(
            output_ids=output_ids,
            num_input_tokens=self.num_input,
            num_output_tokens=len(tokens),
            time_to_first_token=self.time_to_first_token,
            time_per_output_token=decode_time / max(len(tokens), 1),
            acceptance_lengths=self.acceptance_lengths,
            decode_rounds=len(self.acceptance_lengths),
            stage_times=self.stage_times,
            round_timestamps=self.round_timestamps,
            round_trees=self.round_trees,
            prefill_margin=self.prefill_margin,
            verify_margins=self.verify_margins,
            draft_margins=self.draft_margins,
        )


class _DraftFeed:
    """Tracks what the drafter has not seen yet: committed tokens and their target features."""

    def __init__(self, drafter: Drafter, req: _Request, prompt_hidden: torch.Tensor | None):
        self.drafter = drafter
        self.req = req
        self.pending_ids = req.prompt  # [1, n_new]
        self.pending_hidden = prompt_hidden  # [1, n_new, L*H] or None
        self.first_call = True

    def draft(self) -> torch.Tensor:
        req = self.req
        began = req.clock()
        request = DraftRequest(self.pending_ids, self.pending_hidden, req.generated[-1], req.start)
        logits = self.drafter.draft(request)  # [D, V]
        expected = (self.drafter.block_size - 1, req.target.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"drafter returned logits of shape {list(logits.shape)}, expected {list(expected)}")
        elapsed = req.clock() - began
        if self.first_call:
            # As in the reference: the drafter's first call also prefills its context, so it
            # is left out of the draft stage and the decode clock restarts after it.
            self.first_call = False
            req.decode_start = req.clock()
        else:
            req.stage_times["draft"] += elapsed
        return logits

    def committed(self, token_ids: list[int], hidden: torch.Tensor | None) -> None:
        """The round accepted `token_ids` (root first); `hidden` [1, len, L*H] their features."""
        self.pending_ids = long_tensor(token_ids, self.req.device).view(1, -1)
        self.pending_hidden = hidden


# --------------------------------------------------------------------------- the three methods


@torch.inference_mode()
def generate_autoregressive(target: HFTarget, input_ids: torch.Tensor, config: DecodeConfig) -> DecodeResult:
    """Plain decoding, one target forward per token: the reference for losslessness."""
    req = _Request(target, input_ids, config, ("draft", "verify", "commit"))
    req.prefill()
    while not req.done():
        began = req.clock()
        token = torch.tensor([[req.generated[-1]]], device=req.device)
        position = torch.tensor([[req.start]], device=req.device)
        out = target.forward(token, position, req.cache)
        verified = req.clock()
        req.stage_times["verify"] += verified - began
        req.generated.append(req.choose(out.logits)[0])
        req.stage_times["commit"] += req.clock() - verified
        req.end_round(1, out.logits)
    return req.result()


@torch.inference_mode()
def generate_dflash(
    target: HFTarget, drafter: Drafter, input_ids: torch.Tensor, config: DecodeConfig
) -> DecodeResult:
    """Linear speculative decoding: verify the drafter's greedy block [bonus, d1..dD]."""
    check_drafter(drafter, target)
    req = _Request(target, input_ids, config, ("draft", "verify", "commit"))
    drafter.begin(target)
    feed = _DraftFeed(drafter, req, req.prefill(drafter.target_layer_ids))
    while not req.done():
        draft_logits = feed.draft()  # [D, V]
        draft_tokens = draft_logits.argmax(dim=-1)  # [D]: the drafter's greedy block
        began = req.clock()
        start = req.start
        block = torch.cat([torch.tensor([req.generated[-1]], device=req.device), draft_tokens.to(req.device)])
        positions = torch.arange(start, start + block.numel(), device=req.device).unsqueeze(0)
        out = target.forward(block.unsqueeze(0), positions, req.cache, hidden_layer_ids=drafter.target_layer_ids)
        verified = req.clock()
        req.stage_times["verify"] += verified - began
        posterior = req.choose(out.logits)  # [D+1]: the target's choice after each block prefix
        drafted = block.tolist()
        accepted = 1
        while accepted < len(drafted) and drafted[accepted] == posterior[accepted - 1]:
            accepted += 1
        req.generated.extend(drafted[1:accepted] + [posterior[accepted - 1]])
        crop_cache(req.cache, start + accepted)
        feed.committed(drafted[:accepted], None if out.hidden is None else out.hidden[:, :accepted])
        req.stage_times["commit"] += req.clock() - verified
        req.end_round(accepted, out.logits[:accepted],
                      lambda: chain_draft_margins(draft_logits, accepted, posterior[accepted - 1]))
    return req.result()


@torch.inference_mode()
def _check_full_attention(target: HFTarget, input_ids: torch.Tensor, config: DecodeConfig, budget: int) -> None:
    """The verify forward passes its own 4-D mask, which the model takes as is: a sliding
    window would not be applied, and the output would stop being the target's. Refused once
    the sequence can outgrow the window (within it, the window masks nothing)."""
    window = getattr(target, "sliding_window", None)
    longest = int(input_ids.shape[-1]) + config.max_new_tokens + budget + 1
    if window is not None and longest > window:
        raise ValueError(
            f"the target uses sliding-window attention (window {window}), which DDTree's tree mask does not "
            f"apply: prompt + max_new_tokens + budget + 1 = {longest} exceeds it (not lossless; unsupported)"
        )


@torch.inference_mode()  # directly on the loop: verify forwards must not record a graph either
def generate_ddtree(
    target: HFTarget,
    drafter: Drafter,
    input_ids: torch.Tensor,
    config: DecodeConfig,
    budget: int,
    build_method: BuildMethod = BuildMethod.AUTO,
) -> DecodeResult:
    """DDTree: verify a best-first tree of up to `budget` draft nodes in one target forward.

    `build_method` picks the core's tree builder (all return the same tree; their speed differs
    with the vocabulary and budget, see benchmarks/decode.py)."""
    budget = check_budget(budget)
    check_drafter(drafter, target)
    _check_full_attention(target, input_ids, config, budget)
    req = _Request(target, input_ids, config, STAGE_ORDER)
    drafter.begin(target)
    feed = _DraftFeed(drafter, req, req.prefill(drafter.target_layer_ids))
    while not req.done():
        draft_logits = feed.draft()

        began = req.clock()
        tree = build_ddtree_tree_from_logits(draft_logits, budget, build_method)
        built = req.clock()
        req.stage_times["tree_build"] += built - began

        start = req.start
        root_token = req.generated[-1]
        inputs = compile_tree_inputs(root_token, tree, start, target.dtype, req.device)
        compiled = req.clock()
        req.stage_times["tree_compile"] += compiled - built

        out = target.forward(
            inputs.input_ids, inputs.position_ids, req.cache,
            attention_mask=inputs.attention_mask, hidden_layer_ids=drafter.target_layer_ids,
        )
        verified = req.clock()
        req.stage_times["verify"] += verified - compiled

        posterior = req.choose(out.logits, [0] + tree.node_depths_list)  # [N+1]: the target's choice at every tree node
        accepted, bonus = follow_verified_tree(tree.child_maps, posterior)
        commit = commit_round([root_token] + tree.node_token_ids_list, accepted, bonus)
        req.generated.extend(commit.tokens[1:] + [commit.bonus_token])
        keep_cache_rows(req.cache, start, commit.keep_indices)  # host ints: no device round trip
        feed.committed(commit.tokens, None if out.hidden is None else _rows_kept(out.hidden, commit.keep_indices))
        req.stage_times["commit"] += req.clock() - verified
        if req.round_trees is not None:
            req.round_trees.append({
                "accepted_indices": commit.keep_indices,
                "tree": {
                    "node_token_ids": tree.node_token_ids_list,
                    "node_depths": tree.node_depths_list,
                    "parents": [int(p) for p in tree.parents],
                },
            })
        req.end_round(commit.acceptance_length, None if not req.records_margins
                      else out.logits.index_select(0, long_tensor(commit.keep_indices, out.logits.device)),
                      lambda: tree_draft_margins(draft_logits, tree, commit.keep_indices, commit.bonus_token))
    return req.result()

