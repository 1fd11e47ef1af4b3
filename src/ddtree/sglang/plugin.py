"""The entry point SGLang runs in every process: `sglang.srt.plugins` -> `ddtree`.

`register()` parses DDTREE_*, registers hooks H1-H3 with SGLang's HookRegistry and arranges
for the self-check to run right after SGLang applies the hooks. SGLang's load_plugins()
catches and only logs what a plugin raises, or what importing it raises
(sglang/srt/plugins/__init__.py:79-84 and :131-137 in 0.5.23), so a failure raised from
register() would leave the server serving plain DFlash. Every error that must stop the
server (a bad config, a hook that did not take, anything else register() hits in strict
mode) is therefore raised from the post-apply check, which load_plugins() calls outside its
try block (:141); if even that cannot be arranged, SystemExit (which `except Exception` does
not catch) stops the process with the one-line reason. This module imports nothing of ours
at its top, so that an import failure happens inside register(), where it is handled too.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ddtree.sglang")

_SELF_CHECK_MARK = "_ddtree_self_check"
_STOPPING = "DDTREE_STRICT=1: stopping instead of serving plain DFlash; DDTREE_STRICT=0 serves without DDTree"


def register() -> None:
    """Zero-argument plugin callable (the entry point)."""
    try:
        _register()
    except Exception as err:  # noqa: BLE001 - load_plugins() would swallow it: decide here
        _register_failed(err)


def _register() -> None:
    from ddtree.sglang import hooks as hook_functions
    from ddtree.sglang.config import enable_setting, load_config
    from ddtree.sglang.errors import PluginConfigError
    from ddtree.sglang.targets import HOOKS

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


def _register_failed(err: Exception) -> None:
    """register() raised (anything but a config error, which stops the server itself): off
    plainly, nothing happens; DDTREE_STRICT=0, the server goes on without DDTree, saying so;
    otherwise (strict, the default) the server stops with one line naming the failure."""
    try:
        from ddtree.sglang.config import enable_setting, strict_setting

        enabled, strict = enable_setting(), strict_setting()
    except Exception:  # noqa: BLE001 - our own modules may be what failed: strict, the default
        enabled, strict = None, True
    reason = f"DDTree plugin: register() failed: {type(err).__name__}: {_one_line(err)}"
    if enabled is False:
        logger.warning("%s (DDTREE_ENABLE off: ignored)", reason)
        return
    if not strict:
        logger.error("%s (DDTREE_STRICT=0: serving without DDTree)", reason)
        _withdraw_hooks()
        return
    logger.error("%s", reason)
    try:
        from ddtree.sglang.errors import PluginRegisterError

        stop: Exception = PluginRegisterError(f"{reason} ({_STOPPING})")
        _install_post_apply_check(config_error=stop, strict=True)
    except Exception:  # noqa: BLE001 - nothing left to raise it from: end the process here
        raise SystemExit(f"{reason} ({_STOPPING})") from None


def _withdraw_hooks() -> None:
    """Take back whatever hooks of ours a failed register() left in SGLang's registry: none
    or all, never some (H1 without H2 would resize the verify for a worker that is not ours)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        for target, hooks in list(HookRegistry._hooks.items()):
            kept = [h for h in hooks if getattr(h[1], "__module__", "") != "ddtree.sglang.hooks"]
            if not kept:
                del HookRegistry._hooks[target]  # apply_hooks would still resolve (import) the target
            elif len(kept) != len(hooks):
                HookRegistry._hooks[target] = kept
    except Exception as err:  # noqa: BLE001 - best effort: the failure is already logged
        logger.error("DDTree plugin: could not withdraw its hooks: %s: %s", type(err).__name__, _one_line(err))


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("..." if len(text) > 300 else "")


_stop_error: Exception | None = None  # raised right after SGLang applies the hooks: the server stops


def _install_post_apply_check(*, config_error: Exception | None, strict: bool) -> None:
    """Wrap HookRegistry.apply_hooks so our self-check runs right after it, once per call;
    `config_error`: raise that instead (kept when the wrapper is already in place)."""
    global _stop_error
    from sglang.srt.plugins.hook_registry import HookRegistry

    if config_error is not None:
        _stop_error = config_error
    current = HookRegistry.__dict__["apply_hooks"]
    inner = current.__func__ if isinstance(current, classmethod) else current
    if getattr(inner, _SELF_CHECK_MARK, False):
        return

    def apply_hooks_then_self_check(cls: Any) -> None:
        inner(cls)
        if _stop_error is not None:
            raise _stop_error
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
