"""After SGLang applied the hooks: did each of ours take? Do the names we use still exist?

SGLang's HookRegistry only logs a target it cannot resolve (an ImportError even shows up as
an AttributeError) and carries on. This module finds out precisely, per hook, and in strict
mode stops the process with a message naming the target.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from ddtree.sglang import hooks as hook_functions
from ddtree.sglang.errors import HookSelfCheckError
from ddtree.sglang.manifest import Manifest, NameKind, RequiredName, signature_from_callable
from ddtree.sglang.targets import HOOKS, HookSpec

logger = logging.getLogger("ddtree.sglang")


class HookState(Enum):
    APPLIED = "applied"
    NOT_REGISTERED = "not-registered"
    UNRESOLVABLE = "unresolvable"  # the target module or attribute could not be loaded
    NOT_APPLIED = "not-applied"  # resolvable, but our hook is not in the call chain


@dataclass(frozen=True)
class HookStatus:
    hook_id: str
    target: str
    state: HookState
    detail: str = ""
    missing_dependency: str | None = None  # a third-party module SGLang could not import

    def line(self) -> str:
        text = f"{self.hook_id} {self.target}: {self.state.value}"
        return f"{text} ({self.detail})" if self.detail else text


@dataclass(frozen=True)
class NameStatus:
    label: str
    ok: bool
    detail: str


@dataclass
class SelfCheckReport:
    hooks: list[HookStatus] = field(default_factory=list)
    names: list[NameStatus] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(h.state is HookState.APPLIED for h in self.hooks) and all(n.ok for n in self.names)

    def failures(self) -> list[str]:
        lines = [h.line() for h in self.hooks if h.state is not HookState.APPLIED]
        lines += [f"{n.label}: {n.detail}" for n in self.names if not n.ok]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "hooks": [dict(asdict(h), state=h.state.value) for h in self.hooks],
            "names": [asdict(n) for n in self.names],
        }


LAST_REPORT: SelfCheckReport | None = None


def _hook_callable(spec: HookSpec) -> Any:
    return getattr(hook_functions, spec.hook_function)


def _holds_hook(fn: Any, hook: Any) -> bool:
    """True if `hook` is one of the closures SGLang's _wrap_fn built around the target.
    Each layer keeps the previous one in __wrapped__ and the hook in its closure."""
    seen = 0
    while fn is not None and seen < 32:
        raw = getattr(fn, "__func__", fn)
        for cell in getattr(raw, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(raw, "__wrapped__", None)
        seen += 1
    return False


def _resolve_error(target: str) -> tuple[str, str | None]:
    """Why `target` does not resolve, plus the missing module if the cause is a third-party
    dependency that is not installed. Imports the module explicitly: pkgutil.resolve_name
    (what SGLang uses) turns an ImportError into a misleading AttributeError."""
    parts = target.split(".")
    module_name = None
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        try:
            found = importlib.util.find_spec(candidate)
        except (ImportError, ValueError):
            found = None
        if found is not None:
            module_name = candidate
            break
    if module_name is None:
        return f"cannot import: no module found for {target}", None
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        third_party = bool(missing) and missing != "sglang"
        return (f"cannot import {module_name}: {type(err).__name__}: {err}",
                missing if third_party else None)
    except Exception as err:  # noqa: BLE001 - reported, never swallowed
        return f"cannot import {module_name}: {type(err).__name__}: {err}", None
    try:
        pkgutil.resolve_name(target)
    except Exception as err:  # noqa: BLE001
        return f"cannot resolve: {type(err).__name__}: {err}", None
    return "", None


def _registry() -> Any:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return HookRegistry


def hook_status(spec: HookSpec) -> HookStatus:
    registry = _registry()
    hook = _hook_callable(spec)
    registered = any(h is hook for _type, h, _src in registry._hooks.get(spec.target, []))
    if not registered:
        return HookStatus(spec.hook_id.value, spec.target, HookState.NOT_REGISTERED,
                          "register() did not register it (DDTREE_ENABLE off?)")
    problem, missing = _resolve_error(spec.target)
    if problem:
        return HookStatus(spec.hook_id.value, spec.target, HookState.UNRESOLVABLE, problem, missing)
    owner_path, attr = spec.target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if spec.target in registry._patched and _holds_hook(current, hook):
        return HookStatus(spec.hook_id.value, spec.target, HookState.APPLIED)
    return HookStatus(spec.hook_id.value, spec.target, HookState.NOT_APPLIED,
                      "HookRegistry did not wrap the target with our hook (see SGLang's log)")


def name_status(required: RequiredName) -> NameStatus:
    """Runtime twin of the gate's static check, for a module that is already imported."""
    module = sys.modules[required.module]
    obj: Any = module
    raw: Any = None
    for part in required.qualname.split("."):
        raw = obj.__dict__.get(part) if isinstance(obj, type) else getattr(obj, part, None)
        if raw is None:
            return NameStatus(required.label, False, "missing at runtime")
        obj = getattr(obj, part)
    if required.kind in (NameKind.FUNCTION, NameKind.METHOD, NameKind.CLASSMETHOD):
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        found = signature_from_callable(fn, drop_first=required.kind is not NameKind.FUNCTION)
        ok = found == required.signature
        return NameStatus(required.label, ok, found if ok else f"signature {found}, expected {required.signature}")
    if required.kind is NameKind.FIELDS:
        names = (
            set(getattr(obj, "__dataclass_fields__", {}))
            | set(getattr(obj, "__annotations__", {}))
            | set(getattr(obj, "__members__", {}))
            | set(vars(obj))
        )
        missing = [n for n in required.fields if n not in names]
        return NameStatus(required.label, not missing, "fields missing: " + ", ".join(missing) if missing else "fields present")
    if required.kind is NameKind.CONSTANT:
        value = repr(obj)
        return NameStatus(required.label, value == required.value, value)
    return NameStatus(required.label, isinstance(obj, type), "class")


def run_self_check(manifest: Manifest | None) -> SelfCheckReport:
    """Check every hook, then every required name whose module this process imported."""
    report = SelfCheckReport(hooks=[hook_status(spec) for spec in HOOKS])
    if manifest is not None:
        for required in manifest.names:
            if required.module in sys.modules:
                report.names.append(name_status(required))
    return report


def enforce(report: SelfCheckReport, *, strict: bool) -> None:
    global LAST_REPORT
    LAST_REPORT = report
    if report.ok:
        logger.info("DDTree self-check passed: %d hooks applied, %d names checked",
                    len(report.hooks), len(report.names))
        return
    message = "DDTree self-check failed: " + "; ".join(report.failures())
    if strict:
        raise HookSelfCheckError(message + " (DDTREE_STRICT=1: stopping instead of serving linear DFlash)")
    logger.error("%s (DDTREE_STRICT=0: continuing; DDTree may be inactive)", message)
