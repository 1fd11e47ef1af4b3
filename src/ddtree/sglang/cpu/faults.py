"""Plugin faults the CPU test server can inject on purpose, to show that a check catches them.

`CPU_TEST_SERVER_FAULT=<name>` in a CPU test server's environment makes its plugin
(ddtree.sglang.cpu.server_plugin) wrap one DDTree worker step with the named fault. This lives
with the CPU test server, which a GPU host never runs. (Not a DDTREE_ variable: the plugin
refuses DDTREE_ names it does not know.) The plugin logs the fault it injected
("fault <name> injected"), which a test asserts; an unknown name raises in the plugin, and
SGLang's load_plugins() logs that and serves with no fault.
"""
from __future__ import annotations

import os
from typing import Any, Callable

ENV_FAULT = "CPU_TEST_SERVER_FAULT"
TARGET_VERIFY = "ddtree.sglang.worker.DDTreeWorkerV2._target_verify"


def verify_without_tree_mask(original: Callable[..., Any], worker: Any, batch: Any, draft_input: Any, inputs: Any,
                             custom_mask: Any, *rest: Any) -> Any:
    """The plugin "forgets" its tree mask: the verify batch reaches attention with none."""
    return original(worker, batch, draft_input, inputs, None, *rest)


# name -> (the dotted target it wraps AROUND, the wrapper)
FAULTS: dict[str, tuple[str, Callable[..., Any]]] = {
    "verify-without-tree-mask": (TARGET_VERIFY, verify_without_tree_mask),
}


def requested_fault(env: dict[str, str] | None = None) -> tuple[str, Callable[..., Any]] | None:
    """The (target, wrapper) asked for by CPU_TEST_SERVER_FAULT, None when unset."""
    name = (os.environ if env is None else env).get(ENV_FAULT, "").strip()
    if not name:
        return None
    if name not in FAULTS:
        raise ValueError(f"{ENV_FAULT}={name!r}: unknown fault (known: {', '.join(sorted(FAULTS))})")
    return FAULTS[name]
