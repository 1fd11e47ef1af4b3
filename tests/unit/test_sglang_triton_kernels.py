"""SGLang 0.5.23's own Triton kernels, fed the inputs DDTree gives them, run in Triton's CPU
interpreter (TRITON_INTERPRET=1). Each kernel file is loaded straight from the real wheel.
With TRITON_INTERPRET=0 (scripts/device_check.sh) the same tests compile them for the GPU.

Out-of-bounds reads are made visible with canaries: every table a kernel reads lives at the
front of a larger NaN-filled buffer, so a read past its end poisons the output instead of
silently returning whatever memory follows."""
from __future__ import annotations

import importlib.util
import os

# Triton reads this when it is first imported, and SGLang's kernels must all be interpreted:
# nothing else in the CPU suite uses Triton. TRITON_INTERPRET=0 runs them compiled, on CUDA.
os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

import pytest  # noqa: E402
import torch  # noqa: E402

from ddtree.sglang.tree_round import build_round_trees, draft_kv_rewrite  # noqa: E402
from ddtree.verify import build_verify_inputs, walk_retrieve_arrays  # noqa: E402
from sglang_plugin.dist import sglang_package_dir  # noqa: E402

pytest.importorskip("triton", reason="the Triton interpreter runs SGLang's kernels on CPU (test extra)")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 compiles the kernels for CUDA: no GPU here", allow_module_level=True)


def load_sglang_kernel_module(relative: str):
    """A fresh module object for an SGLang file, its @triton.jit kernels built for the interpreter."""
    path = sglang_package_dir() / relative
    spec = importlib.util.spec_from_file_location(f"sglang_kernel_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sglang_functions(tmp_path, relative: str, names: tuple[str, ...]):
    """Some functions of an SGLang file whose module imports the server's platform layer (not
    importable on CPU): their own source (decorators included), cut from the real file with
    ast, in a module of their own with the torch/triton imports they use."""
    import ast

    source = (sglang_package_dir() / relative).read_text()
    lines = source.splitlines()
    cut = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            cut.append("\n".join(lines[first - 1 : node.end_lineno]))
    assert len(cut) == len(names), f"{relative}: expected {names}"
    stem = relative.rsplit("/", 1)[-1].removesuffix(".py")
    path = tmp_path / f"sglang_cut_{stem}.py"
    path.write_text("import torch\nimport triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(cut) + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_nan_canary(table: torch.Tensor, spare_rows: int) -> torch.Tensor:
    """`table` as a view onto the front of a buffer whose further rows are NaN."""
    buffer = torch.full((table.shape[0] + spare_rows, *table.shape[1:]), float("nan"), dtype=table.dtype,
                        device=DEVICE)
    buffer[: table.shape[0]] = table
    return buffer[: table.shape[0]]


def neox_rope_reference(k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """k: [T, heads, D] float32, cos_sin: [P, D] (cos | sin halves), positions: [T] -> roped k."""
    half = k.shape[-1] // 2
    cos = cos_sin[positions, :half].unsqueeze(1)
    sin = cos_sin[positions, half:].unsqueeze(1)
    first, second = k[..., :half], k[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("prefix", [[31], [31, 28, 5], [27, 31]])
def test_draft_kv_rewrite_stays_inside_dflashs_rope_table(prefix):
    """DFlashWorkerV2 sizes the fused draft-KV RoPE table for context_len + B
    (max_position_hint, dflash_worker_v2.py:1074-1075; fused_kv_materialize.py:415-425), and the
    kernel ropes every row it is given, committed or not. The worker hands it B rows per request
    (draft_kv_rewrite), not the N-wide window: with requests at the end of the context every
    position stays in the table, and every row is roped at prefix + j."""
    fused = load_sglang_kernel_module("kernels/ops/speculative/fused_kv_materialize.py")
    context_len, block, width = 32, 4, 9  # B = 4, N = 9 > B
    layers, heads, head_dim = 2, 2, 8
    prefix_lens = torch.tensor(prefix, dtype=torch.int64)
    bs = len(prefix)
    accept_index = torch.full((bs, block), -1, dtype=torch.int32)  # the worker's accept width: B
    accept_index[:, 0] = torch.arange(bs, dtype=torch.int32) * width
    rewrite = draft_kv_rewrite(torch.zeros(bs * width, 1), accept_index, torch.arange(bs * width), prefix_lens, width)
    positions = rewrite.positions  # what the worker hands the writer
    rows = positions.numel()
    gen = torch.Generator().manual_seed(3)
    cos_sin = with_nan_canary(torch.randn(context_len + block, head_dim, generator=gen), spare_rows=width)
    kv = torch.randn(rows, layers, 2 * heads * head_dim, generator=gen)
    norm_weight = torch.ones(layers, head_dim)
    eps = torch.full((layers,), 1e-6)

    k_out, _v_out = fused._fused_norm_rope_stacked(
        kv.to(DEVICE), norm_weight.to(DEVICE), eps.to(DEVICE), cos_sin, positions.to(DEVICE), heads, head_dim, head_dim
    )
    k_out, cos_sin = k_out.cpu(), cos_sin.cpu()

    assert torch.isfinite(k_out).all(), "a row read past the RoPE table (NaN canary reached the output)"
    k_raw = kv[:, 0, : heads * head_dim].view(rows, heads, head_dim)
    k_normed = k_raw * torch.rsqrt(k_raw.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rows == bs * block  # every row a round can commit, and no more
    expected = neox_rope_reference(k_normed, cos_sin, prefix_lens.repeat_interleave(block) + torch.arange(rows) % block)
    torch.testing.assert_close(k_out[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bs, depth, budget, vocab", [(1, 1, 1, 5), (1, 15, 64, 3), (3, 4, 12, 6), (4, 7, 20, 2)])
def test_sglangs_greedy_tree_walk_needs_only_b_accept_columns(tmp_path, bs, depth, budget, vocab):
    """SGLang's greedy tree verify (its Triton kernel, spec_tree.py) run on DDTree's verify
    inputs with accept_index [bs, B] (B = depth + 1, the accept width the worker declares)
    accepts exactly what our N-step walk accepts: no tree is deeper than B-1. Ragged trees
    (one request has a single likely depth), tiny vocabularies so the target follows long
    paths, budget and N well above B."""
    kernels = load_sglang_functions(tmp_path, "kernels/ops/speculative/spec_tree.py",
                                    ("verify_tree_greedy_kernel_triton", "verify_tree_greedy_triton"))
    gen = torch.Generator().manual_seed(bs * 1000 + budget)
    logits = torch.randn(bs, depth, vocab, generator=gen) * 4
    logits[..., 0] += 20  # a dominant token per depth: the best-first tree holds a full-depth chain
    if bs > 1:
        logits[1, 1:] = float("-inf")  # this request's tree stops at depth 1
    trees = build_round_trees(logits, budget, budget)
    width, block = budget + 1, depth + 1
    inputs = build_verify_inputs(trees, torch.zeros(bs, dtype=torch.int64), torch.full((bs,), 7), width=width)
    # A target that follows the tree's first child at every node: the longest accepted paths.
    child = inputs.retrieve_next_token.clamp(min=0)
    target = torch.where(inputs.retrieve_next_token >= 0, torch.gather(inputs.input_ids, 1, child), 1)
    predicts = torch.zeros(bs * width, dtype=torch.int32, device=DEVICE)
    accept_index = torch.full((bs, block), -1, dtype=torch.int32, device=DEVICE)
    accept_num = torch.zeros(bs, dtype=torch.int32, device=DEVICE)
    kernels.verify_tree_greedy_triton(predicts, accept_index, accept_num, *(t.to(DEVICE) for t in (
        inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token, inputs.retrieve_next_sibling, target)))
    accept_index, accept_num = accept_index.cpu(), accept_num.cpu()
    ours, accepted, _bonus = walk_retrieve_arrays(inputs.input_ids, inputs.retrieve_index, inputs.retrieve_next_token,
                                                 inputs.retrieve_next_sibling, target)  # N steps
    assert (ours[:, block:] == -1).all()
    assert torch.equal(accept_index.long(), ours[:, :block]) and torch.equal(accept_num.long(), accepted)
    assert int(accepted[0]) == depth  # the walk really went B-1 deep: the last column is used


def test_the_cpu_servers_fused_rope_standin_equals_sglangs_compiled_kernel():
    """ddtree.sglang.cpu.fused_rope rounds to bfloat16 to nearest, as the compiled kernel does
    (the interpreter truncates; that case is tests/sglang_server/test_cpu_parity.py). Compiled,
    the kernel sums the squares in its own order: a last-bit float32 difference may move a
    bfloat16 rounding, so at most two bfloat16 steps of a head, and almost every value equal."""
    if DEVICE == "cpu":
        pytest.skip("compiled for CUDA only (TRITON_INTERPRET=0, scripts/device_check.sh); the interpreted "
                    "kernel is compared in tests/sglang_server/test_cpu_parity.py")
    from ddtree.sglang.cpu.fused_rope import table_qk_norm_rope_cpu

    kernel = load_sglang_kernel_module("kernels/ops/attention/table_qk_norm_rope.py")
    gen = torch.Generator().manual_seed(5)
    for head_dim, hq, hk, tokens in ((32, 4, 2, 64), (128, 32, 8, 16), (256, 8, 1, 8)):
        qkv = (torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
        positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
        inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(4096).float()[:, None] * inv_freq[None]
        table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)  # fp32, as on a GPU
        weights = [(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16).to(DEVICE) for _ in "qk"]
        theirs, ours = qkv.clone(), qkv.clone()
        kernel.table_qk_norm_rope_(theirs, positions, *weights, table, hq, hk, head_dim, 1e-6)
        table_qk_norm_rope_cpu(ours, positions, *weights, table, hq, hk, head_dim, 1e-6)
        qk = (hq + hk) * head_dim
        assert torch.equal(theirs[:, qk:], qkv[:, qk:]) and torch.equal(ours[:, qk:], qkv[:, qk:])
        a = theirs[:, :qk].float().unflatten(1, (hq + hk, head_dim))
        b = ours[:, :qk].float().unflatten(1, (hq + hk, head_dim))
        spread = float(((a - b).abs().amax(-1) / a.abs().amax(-1)).max())
        assert spread <= 2 * 2 ** -7, (head_dim, spread)
        assert float((a == b).float().mean()) > 0.99, head_dim
