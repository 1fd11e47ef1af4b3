"""Stand-in for the CPU build of sgl-kernel, which is not on PyPI: the ops SGLang 0.5.23's
CPU engine imports by name, in pure torch (ddtree.sglang.cpu.kernels). Only the CPU test
server's environment puts this folder on sys.path (ddtree.sglang.cpu.environment); a GPU
host never sees it, and a real sgl_kernel installed there wins over it (site order)."""
from ddtree.sglang.cpu.kernels import (  # noqa: F401  (the names SGLang imports)
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.0+ddtree-cpu-standin"
