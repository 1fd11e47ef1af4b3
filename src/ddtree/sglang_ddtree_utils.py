"""The seed's module name, kept so its smoke script runs unchanged.

The seed imports `from sglang_ddtree_utils import build_ddtree_tree_from_logits, ...` after
`sys.path.insert(0, <dir>)`; pointing <dir> at this package directory makes this file that
module. It only re-exports the core.
"""
from __future__ import annotations

import os
import sys

try:
    import ddtree  # noqa: F401
except ImportError:  # the package is not installed: its parent directory holds it
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddtree import (  # noqa: E402
    DraftTree,
    assert_prefix_closed,
    build_ddtree_tree_from_logits,
    follow_verified_tree,
    summarize_ddtree,
)

__all__ = [
    "DraftTree",
    "assert_prefix_closed",
    "build_ddtree_tree_from_logits",
    "follow_verified_tree",
    "summarize_ddtree",
]
