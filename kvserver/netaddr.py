"""Addresses built from a host and a port, the one way every process writes them.

An IPv6 host goes in brackets (``[::1]:9470``, ``tcp://[::1]:9471``): the form gRPC, ZMQ,
URLs and people read unambiguously. ``tcp://::1:9471`` (what version-1 daemons wrote into their
fleet records before session 14) still parses where addresses are read (the port is after the
last colon), but nothing writes it any more.
"""

from __future__ import annotations


def host_port(host: str, port: int | str) -> str:
    """``HOST:PORT``, ``[HOST]:PORT`` for an IPv6 ``host`` (one with a colon); a host already
    in brackets is kept as it is."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def is_ipv6_endpoint(address: str) -> bool:
    """Whether a ZMQ ``tcp://HOST:PORT`` endpoint names an IPv6 literal host, bracketed
    (``tcp://[::1]:5``) or as version-1 daemons wrote it (``tcp://::1:5``): a ZMQ socket
    connects to such a host only with ``ZMQ_IPV6`` set. Not set for any other endpoint, where
    it would make an IPv4 peer read as ``::ffff:a.b.c.d``."""
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://") :].rpartition(":")[0]
    return host.startswith("[") or ":" in host
