"""What DDTree supports inside SGLang, as pure checks (no sglang import).

Each check raises UnsupportedSetupError with the reason, so the server stops at startup
instead of serving linear DFlash or garbage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ddtree.sglang.errors import UnsupportedSetupError

# Backends that honour a custom tree mask in TARGET_VERIFY when captured with one.
# FA3 and TRTLLM capture the verify graph mask-less: trees would attend to siblings.
# DDTreeCpuAttnBackend (ddtree_cpu) exists only in the CPU test server (ddtree.sglang.cpu).
SUPPORTED_ATTENTION_BACKEND_CLASSES = frozenset({"FlashInferAttnBackend", "TritonAttnBackend", "DDTreeCpuAttnBackend"})
SUPPORTED_ATTENTION_BACKEND_FLAGS = frozenset({"flashinfer", "triton", "ddtree_cpu"})
SUPPORTED_PAGE_SIZE = 1


@dataclass(frozen=True)
class ServerSetup:
    """The parts of SGLang's resolved server arguments DDTree cares about (None: not decided yet)."""

    attention_backend: str | None
    decode_attention_backend: str | None
    page_size: int | None
    pp_size: int
    attn_dp: bool
    # With SGLang's default speculative_attention_mode "prefill", target verify runs on the
    # prefill backend: it must apply the tree mask too (FA3 there would ignore it).
    prefill_attention_backend: str | None = None


def check_server_setup(setup: ServerSetup) -> None:
    for flag_name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = getattr(setup, flag_name)
        if value is not None and value not in SUPPORTED_ATTENTION_BACKEND_FLAGS:
            raise UnsupportedSetupError(
                f"DDTree: --{flag_name.replace('_', '-')} {value} cannot apply a tree mask in "
                f"target verify (supported: {', '.join(sorted(SUPPORTED_ATTENTION_BACKEND_FLAGS))})"
            )
    if setup.page_size is not None and setup.page_size != SUPPORTED_PAGE_SIZE:
        raise UnsupportedSetupError(
            f"DDTree: --page-size {setup.page_size} is not supported yet (only 1): accepted "
            "tree nodes are moved token by token to the front of the verify window"
        )
    if setup.pp_size != 1:
        raise UnsupportedSetupError(f"DDTree: pipeline parallelism is not supported (pp_size={setup.pp_size})")
    if setup.attn_dp:
        raise UnsupportedSetupError("DDTree: DP attention is not supported")


def check_attention_backend_class(class_name: str) -> None:
    if class_name not in SUPPORTED_ATTENTION_BACKEND_CLASSES:
        raise UnsupportedSetupError(
            f"DDTree: attention backend {class_name} captures target verify without a tree mask "
            f"(supported: {', '.join(sorted(SUPPORTED_ATTENTION_BACKEND_CLASSES))})"
        )


def plan_verify_width(*, block_size: int, budget: int) -> int:
    """N = budget + 1. DFlash reserves 2N KV slots per request per round; the draft writes B
    of them, so N >= B keeps the draft window inside the reserve."""
    if block_size < 2:
        raise UnsupportedSetupError(f"DDTree: drafter block size must be >= 2, got {block_size}")
    width = budget + 1
    if width < block_size:
        raise UnsupportedSetupError(
            f"DDTree: DDTREE_BUDGET={budget} gives verify width {width} < drafter block size "
            f"{block_size}; use DDTREE_BUDGET >= {block_size - 1}"
        )
    return width


def resolve_draft_block_size(explicit: int | None, from_drafter_config: int | None) -> int:
    """The drafter block size B as SGLang's _handle_dflash resolves it (explicit flag first,
    then the drafter's config, then 16)."""
    if explicit is not None:
        return int(explicit)
    if from_drafter_config is not None:
        return int(from_drafter_config)
    return 16


def check_tensor_parallel_head(*, tp_size: int, vocab_parallel: bool) -> None:
    """TP > 1 works through the sharded top-K merge (local top-K + logsumexp, gathered), which
    needs to know which token ids the local lm_head rows hold (SGLang's shard_indices)."""
    if tp_size < 1:
        raise UnsupportedSetupError(f"DDTree: tensor-parallel size must be >= 1, got {tp_size}")
    if tp_size > 1 and not vocab_parallel:
        raise UnsupportedSetupError(
            f"DDTree: tensor parallelism {tp_size} needs a vocab-parallel target lm_head (with "
            "shard_indices) for the sharded top-K merge"
        )


class StaticBuffer(NamedTuple):
    what: str
    nbytes: int


_GIB = 1 << 30


def verify_graph_buffers(
    *, backend_class: str, max_bs: int, width: int, vocab_size: int, context_len: int
) -> tuple[StaticBuffer, ...]:
    """The target's CUDA-graph buffers that grow with the verify width N, as SGLang 0.5.23 sizes
    them for max_num_token = max_bs * N rows (decode_cuda_graph_runner.py:424-429)."""
    rows = max_bs * width
    buffers = [StaticBuffer(f"graph logits [max_bs*N={rows}, V={vocab_size}] fp32", rows * vocab_size * 4)]
    if backend_class == "FlashInferAttnBackend":  # flashinfer_backend.py:1106-1117, 1134-1138
        # KV indices: one int32 buffer per wrapper (one for full attention, which DDTree needs).
        buffers.append(StaticBuffer(f"FlashInfer graph KV indices [{rows} x context {context_len}] int32",
                                    rows * context_len * 4))
        buffers.append(StaticBuffer(f"FlashInfer graph mask [{rows} x context {context_len}] uint8", rows * context_len))
    elif backend_class == "TritonAttnBackend":  # triton_backend.py:1224-1246
        buffers.append(StaticBuffer(f"Triton graph KV indices [{rows} x context {context_len}] int64", rows * context_len * 8))
        buffers.append(StaticBuffer(
            f"Triton verify mask [{max_bs} x N={width} x (context {context_len} + N)] uint8",
            max_bs * width * (context_len + width),
        ))
    return tuple(buffers)


def check_verify_buffers_fit(
    buffers: tuple[StaticBuffer, ...], *, free_bytes: int, budget: int, max_bs: int, context_len: int
) -> None:
    """Refuse at startup, naming the numbers, when the N-wide verify graph buffers alone exceed
    the device memory left after the KV pool: graph capture would run out of memory. (A
    necessary bound: activations need room too.)"""
    total = sum(b.nbytes for b in buffers)
    if total <= free_bytes:
        return
    parts = "; ".join(f"{b.what} = {b.nbytes / _GIB:.2f} GiB" for b in buffers)
    raise UnsupportedSetupError(
        f"DDTree: the verify CUDA-graph buffers need {total / _GIB:.2f} GiB ({parts}) but only "
        f"{free_bytes / _GIB:.2f} GiB is free after the KV pool; lower DDTREE_BUDGET ({budget}, "
        f"N = {budget + 1}), --cuda-graph-max-bs ({max_bs}) or --context-length ({context_len})"
    )
