"""``needs_ipv6``: a test that binds ``::1`` runs where this host has IPv6 loopback (CI's
runners and this project's machines do); elsewhere it is skipped, saying why."""

from __future__ import annotations

import socket

import pytest


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(
    not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this host"
)
