"""Open the right transport for an inventory host (SSH is imported only when needed)."""
from __future__ import annotations

from collections.abc import Sequence

from ddtree_ops.inventory import Host, TransportKind
from ddtree_ops.transport.base import Transport


def open_transport(host: Host, *, accept_new_host_keys: bool = False) -> Transport:
    """A connected transport; raises a `TransportError` subclass when the host cannot be reached."""
    if host.transport is TransportKind.LOCAL:
        from ddtree_ops.transport.local import LocalTransport

        return LocalTransport(host.name, command_timeout=host.command_timeout)
    from ddtree_ops.transport.ssh import SshTransport

    return SshTransport(host, accept_new_host_keys=accept_new_host_keys)


def check_connection_config(hosts: Sequence[Host]) -> None:
    """Read every SSH host's ssh_config (with its ProxyJump chain) and known_hosts before any
    connection: one that cannot be read, a bad Port or ProxyJump, an unsupported directive, or a
    malformed known_hosts line is a config error (ConfigError, exit 3) for the whole command,
    not an unreachable host."""
    ssh_hosts = [h for h in hosts if h.transport is not TransportKind.LOCAL]
    if not ssh_hosts:
        return
    from ddtree_ops.transport.known_hosts import check_known_hosts
    from ddtree_ops.transport.ssh_config import jump_targets, load_ssh_config, resolve_target

    for host in ssh_hosts:
        load_ssh_config(host)
        jump_targets(host, resolve_target(host))
        check_known_hosts(host)
