"""Open the right transport for an inventory host (SSH is imported only when needed)."""
from __future__ import annotations

from ddtree_ops.inventory import Host, TransportKind
from ddtree_ops.transport.base import Transport


def open_transport(host: Host, *, accept_new_host_keys: bool = False) -> Transport:
    """A connected transport; raises a `TransportError` subclass when the host cannot be reached."""
    if host.transport is TransportKind.LOCAL:
        from ddtree_ops.transport.local import LocalTransport

        return LocalTransport(host.name, command_timeout=host.command_timeout)
    from ddtree_ops.transport.ssh import SshTransport

    return SshTransport(host, accept_new_host_keys=accept_new_host_keys)
