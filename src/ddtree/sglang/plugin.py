"""The entry point SGLang runs in every process: `sglang.srt.plugins` -> `ddtree`.

`register()` parses DDTREE_*, registers hooks H1-H3 with SGLang's HookRegistry and arranges
for the self-check to run right after SGLang applies the hooks. SGLang's load_plugins()
catches and only logs exceptions raised by a plugin, so every error that must stop the
server (bad config, a hook that did not take) is raised from the post-apply check, which
load_plugins() calls outside its try block.
"""
from __future__ import annotations

import logging
from typing import Any

from ddtree.sglang import hooks as hook_functions
from ddtree.sglang.config import enable_setting, load_config
from ddtree.sglang.errors import PluginConfigError
from ddtree.sglang.targets import HOOKS

logger = logging.getLogger("ddtree.sglang")

_SELF_CHECK_MARK = "_ddtree_self_check"


def register() -> None:
    """Zero-argument plugin callable (the entry point)."""
    try:
        config = load_config()
    except PluginConfigError as err:
        if enable_setting() is False:  # plainly off: an installed plugin must stay harmless
            logger.warning("DDTree plugin disabled (DDTREE_ENABLE off); ignoring a bad setting: %s", err)
            return
        logger.error("DDTree plugin: %s", err)
        _install_post_apply_check(config_error=err, strict=True)
        return
    hook_functions.set_active_config(config)
    if not config.enabled:
        logger.info("DDTree plugin installed but disabled (set DDTREE_ENABLE=1 to enable)")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in HOOKS:
        HookRegistry.register(
            spec.target, getattr(hook_functions, spec.hook_function), HookType[spec.kind.value]
        )
    _install_post_apply_check(config_error=None, strict=config.strict)


def _install_post_apply_check(*, config_error: PluginConfigError | None, strict: bool) -> None:
    """Wrap HookRegistry.apply_hooks so our self-check runs right after it, once per call."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    current = HookRegistry.__dict__["apply_hooks"]
    inner = current.__func__ if isinstance(current, classmethod) else current
    if getattr(inner, _SELF_CHECK_MARK, False):
        return

    def apply_hooks_then_self_check(cls: Any) -> None:
        inner(cls)
        if config_error is not None:
            raise config_error
        post_apply_self_check(strict=strict)

    setattr(apply_hooks_then_self_check, _SELF_CHECK_MARK, True)
    apply_hooks_then_self_check.__wrapped__ = inner  # type: ignore[attr-defined]
    apply_hooks_then_self_check.__doc__ = inner.__doc__
    HookRegistry.apply_hooks = classmethod(apply_hooks_then_self_check)  # type: ignore[method-assign]


def post_apply_self_check(*, strict: bool) -> None:
    from ddtree.sglang.manifests import manifest_for_installed_sglang
    from ddtree.sglang.selfcheck import NameStatus, enforce, run_self_check

    manifest, version = manifest_for_installed_sglang()  # the structure expected of this version
    report = run_self_check(manifest)
    if manifest is None:
        report.names.append(NameStatus(f"sglang {version}", False, "no DDTree manifest is shipped"))
    elif manifest.sglang_version != version:
        # Not pinned: `deploy` installs it only when qualified (or forced); names are checked.
        logger.warning("DDTree: sglang %s is not a pinned version; its names are checked against sglang %s",
                       version, manifest.sglang_version)
    enforce(report, strict=strict)
