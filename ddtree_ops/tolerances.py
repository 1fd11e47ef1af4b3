"""Comparison defaults shared by `ddtree_ops.report.decode_checks`, `ddtree_ops.server_status` and
the CLI. A module of its own so that the CLI can show them in `--help` without importing the
report code at start-up."""
from __future__ import annotations

DEFAULT_TAU_TOLERANCE = 0.5  # tokens per round, absolute
# `status`: fewer request-rounds since the server started, and its live acceptance is noise (shown, not judged).
DEFAULT_MIN_REQUEST_ROUNDS = 100
# tokens per round the server's acceptance may fall below the offline one (sglang-e2e and report)
from ddtree_ops.hostside.acceptance import DEFAULT_ACCEPTANCE_TOLERANCE  # noqa: E402,F401
