"""The suite's own guard (tests/conftest.py): only loopback is looked up, so a test host meant
to be unreachable sends no DNS query and no packet off the machine."""
from __future__ import annotations

import socket

import pytest


@pytest.mark.parametrize("host", ["gpu-a.invalid", "10.0.0.9", "example.com", "192.0.2.1"])
def test_a_lookup_of_anything_but_loopback_fails_as_an_unknown_name(host):
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(host, 22)
    with pytest.raises(socket.gaierror):
        socket.create_connection((host, 22), timeout=0.1)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_is_looked_up_as_usual(host):
    try:
        assert socket.getaddrinfo(host, 22)
    except socket.gaierror as err:  # ::1 or localhost may be absent from a container: never our guard
        assert err.strerror != "Name or service not known" or host in ("::1", "localhost"), err
