"""Plugin configuration from DDTREE_* environment variables.

A plugin cannot add fields to SGLang's ServerArgs (unknown argparse destinations are
dropped), so the operator configures DDTree through the environment, which every process
SGLang spawns inherits.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddtree.sglang.errors import PluginConfigError

ENV_PREFIX = "DDTREE_"
OPS_PREFIX = "DDTREE_OPS_"  # the operator CLI's own variables, not ours
ENV_ENABLE = "DDTREE_ENABLE"
ENV_BUDGET = "DDTREE_BUDGET"
ENV_TOPK = "DDTREE_TOPK"
ENV_STRICT = "DDTREE_STRICT"
ENV_METRICS_INTERVAL = "DDTREE_METRICS_INTERVAL"
# Internal: written by hook H1 in the launcher process (the drafter block size B as SGLang
# resolved it), inherited by the scheduler processes where the worker is built.
ENV_DRAFT_BLOCK_SIZE = "DDTREE_DRAFT_BLOCK_SIZE"
KNOWN_VARIABLES = frozenset(
    {ENV_ENABLE, ENV_BUDGET, ENV_TOPK, ENV_STRICT, ENV_METRICS_INTERVAL, ENV_DRAFT_BLOCK_SIZE}
)

# SGLang's own allow-list of plugin entry-point names (srt/plugins/__init__.py:51-70): when it
# is set, every plugin it does not name is skipped, ours included.
ENV_SGLANG_PLUGINS = "SGLANG_PLUGINS"
PLUGIN_NAME = "ddtree"  # our entry point's name in the sglang.srt.plugins group

DEFAULT_BUDGET = 32
DEFAULT_METRICS_INTERVAL = 50  # verify rounds between two metric log lines
# Verify width N = budget + 1 is a CUDA-graph capture width and a mask side; keep it sane.
MIN_BUDGET, MAX_BUDGET = 1, 1024

# Server defaults `ddtree-ops deploy --budget` writes next to the deployed `ddtree` package:
# {"variables": {DDTREE_*: value}, "provenance": {...}}. A variable set in the environment wins.
DEFAULTS_FILE_NAME = "ddtree_server_defaults.json"
DEFAULTS_PATH = Path(__file__).resolve().parents[2] / DEFAULTS_FILE_NAME
DEFAULTABLE_VARIABLES = frozenset({ENV_ENABLE, ENV_BUDGET, ENV_TOPK, ENV_STRICT, ENV_METRICS_INTERVAL})

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class DDTreeConfig:
    enabled: bool = False
    budget: int = DEFAULT_BUDGET  # draft nodes per tree (root excluded)
    topk: int = DEFAULT_BUDGET  # per-depth candidates kept from the drafter, <= budget
    strict: bool = True  # a hook that did not take stops the server
    metrics_interval: int = DEFAULT_METRICS_INTERVAL  # 0 disables the periodic log line
    draft_block_size: int | None = None  # B, set by hook H1 (None: H1 has not run)

    @property
    def verify_width(self) -> int:
        """N: tokens per request in the target verify (the root + the budget)."""
        return self.budget + 1

    def as_env(self) -> dict[str, str]:
        """The variables that reproduce this config (for launching servers, for records)."""
        return {
            ENV_ENABLE: "1" if self.enabled else "0",
            ENV_BUDGET: str(self.budget),
            ENV_TOPK: str(self.topk),
            ENV_STRICT: "1" if self.strict else "0",
            ENV_METRICS_INTERVAL: str(self.metrics_interval),
        }


def _parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default  # `DDTREE_STRICT=${UNSET}` keeps the default, as the int settings do
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise PluginConfigError(f"{name}: expected one of 1/0/true/false/yes/no/on/off, got {raw!r}")


def _parse_int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise PluginConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise PluginConfigError(f"{name}: must be between {lo} and {hi}, got {value}")
    return value


DEFAULTS_READ_MAX = 1 << 16  # bytes; deploy writes a few hundred


def _read_defaults_text(path: Path) -> str | None:
    """The defaults file's text, None when there is none; OSError/ValueError when it is not a
    plain file of at most DEFAULTS_READ_MAX bytes of UTF-8 (a FIFO must not hang the server)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a plain file")
        data = os.read(fd, DEFAULTS_READ_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > DEFAULTS_READ_MAX:
        raise ValueError(f"larger than {DEFAULTS_READ_MAX} bytes")
    return data.decode("utf-8")


def read_server_defaults(path: Path = DEFAULTS_PATH) -> dict[str, str]:
    """The deployed defaults file's variables ({} when there is none); a malformed file (one
    nested past Python's stack included), an unknown variable or a bad value raises
    PluginConfigError naming the file."""
    try:
        text = _read_defaults_text(path)
        if text is None:
            return {}
        document = json.loads(text)
    except RecursionError:
        raise PluginConfigError(f"{path}: unreadable server defaults: nested too deep") from None
    except (OSError, ValueError) as err:
        raise PluginConfigError(f"{path}: unreadable server defaults: {err}") from None
    variables = document.get("variables") if isinstance(document, dict) else None
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise PluginConfigError(f"{path}: variables: expected an object of strings")
    unknown = sorted(set(variables) - DEFAULTABLE_VARIABLES)
    if unknown:
        raise PluginConfigError(f"{path}: {unknown[0]}: not a server default "
                                f"(allowed: {', '.join(sorted(DEFAULTABLE_VARIABLES))})")
    try:
        _parse_variables(variables)
    except PluginConfigError as err:
        raise PluginConfigError(f"{path}: {err}") from None
    return dict(variables)


def _with_defaults(env: Mapping[str, str], defaults_path: Path) -> dict[str, str]:
    """The file's defaults under the environment: a variable set (non-blank) in env wins."""
    merged = read_server_defaults(defaults_path)
    merged.update({k: v for k, v in env.items() if k not in merged or v.strip() != ""})
    return merged


def strict_setting(env: Mapping[str, str] | None = None) -> bool:
    """DDTREE_STRICT as the environment sets it, for when the rest of the config cannot be
    read: strict unless plainly off there (the defaults file may be what is broken)."""
    raw = (os.environ if env is None else env).get(ENV_STRICT, "").strip().lower()
    return raw not in _FALSE


def enable_setting(env: Mapping[str, str] | None = None, defaults_path: Path = DEFAULTS_PATH) -> bool | None:
    """DDTREE_ENABLE as parsed (unset: the deployed default, else False), or None when it or
    the defaults file is malformed."""
    env = os.environ if env is None else env
    try:
        if env.get(ENV_ENABLE, "").strip():  # set here: the file cannot change it (nor, broken, hide it)
            return _parse_bool(env, ENV_ENABLE, False)
        return _parse_bool(_with_defaults(env, defaults_path), ENV_ENABLE, False)
    except PluginConfigError:
        return None


def load_config(env: Mapping[str, str] | None = None, defaults_path: Path = DEFAULTS_PATH) -> DDTreeConfig:
    """Parse DDTREE_* variables over the deployed defaults file (when there is one); a bad
    value raises PluginConfigError naming the variable (or the file).

    An unknown DDTREE_* name is an error too: a typo (DDTREE_BUDGTE) would otherwise run
    the server with the default budget without anyone noticing.
    """
    env = _with_defaults(os.environ if env is None else env, defaults_path)
    unknown = sorted(
        k
        for k in env
        if k.startswith(ENV_PREFIX) and not k.startswith(OPS_PREFIX) and k not in KNOWN_VARIABLES
    )
    if unknown:
        raise PluginConfigError(
            f"{unknown[0]}: unknown variable (known: {', '.join(sorted(KNOWN_VARIABLES))})"
        )
    return _parse_variables(env)


def config_from_variables(variables: Mapping[str, str]) -> DDTreeConfig:
    """The config these DDTREE_* variables alone make (a deploy's server defaults, read back on
    the operator side); PluginConfigError names a bad one."""
    return _parse_variables(variables)


def _parse_variables(env: Mapping[str, str]) -> DDTreeConfig:
    enabled = _parse_bool(env, ENV_ENABLE, False)
    budget = _parse_int(env, ENV_BUDGET, DEFAULT_BUDGET, MIN_BUDGET, MAX_BUDGET)
    topk = _parse_int(env, ENV_TOPK, budget, 1, MAX_BUDGET)
    if topk > budget:
        # More candidates per depth than nodes in the whole tree can never be used.
        raise PluginConfigError(f"{ENV_TOPK}: must be <= {ENV_BUDGET} ({budget}), got {topk}")
    strict = _parse_bool(env, ENV_STRICT, True)
    interval = _parse_int(env, ENV_METRICS_INTERVAL, DEFAULT_METRICS_INTERVAL, 0, 10**9)
    block = _parse_int(env, ENV_DRAFT_BLOCK_SIZE, 0, 0, MAX_BUDGET + 1) or None
    return DDTreeConfig(
        enabled=enabled, budget=budget, topk=topk, strict=strict, metrics_interval=interval,
        draft_block_size=block,
    )


def plugins_filter_problem(value: str | None) -> str | None:
    """One line naming the problem when SGLANG_PLUGINS (its raw value, None when unset) makes
    SGLang skip DDTree, else None. SGLang splits a non-empty value on commas and strips each
    name; a value of only separators allows nothing at all."""
    if not value:
        return None
    allowed = {name.strip() for name in value.split(",") if name.strip()}
    if PLUGIN_NAME in allowed:
        return None
    return (f"{ENV_SGLANG_PLUGINS}={value!r} does not list {PLUGIN_NAME}: SGLang skips every plugin it does "
            f"not name, so DDTree never registers and DDTREE_ENABLE=1 serves plain DFlash; add "
            f"{PLUGIN_NAME} to it or unset it")
