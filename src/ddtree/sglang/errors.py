"""Errors of the SGLang plugin. Each message names the variable, file or hook target."""
from __future__ import annotations


class DDTreePluginError(RuntimeError):
    """Base of every error the plugin raises on purpose."""


class PluginConfigError(DDTreePluginError, ValueError):
    """A DDTREE_* environment variable has a value we cannot use."""


class UnsupportedSetupError(DDTreePluginError, ValueError):
    """The server configuration is outside what DDTree supports (backend, page size, ...)."""


class HookSelfCheckError(DDTreePluginError):
    """A hook did not take, or a name we rely on is missing: raised in strict mode."""


class PluginRegisterError(DDTreePluginError):
    """register() failed for a reason of its own (not a DDTREE_* value): raised, in strict
    mode, where SGLang's load_plugins() does not catch it."""
