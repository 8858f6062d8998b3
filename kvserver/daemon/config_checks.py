"""The daemon's checks of settings that go together, in the operator's words: the listeners'
ports, the leases and the ZMQ send timeout, access (tokens, tenants, TLS, CURVE, a host beyond
loopback) and the network tier (peers).

Runs where a :class:`~kvserver.daemon.config.DaemonConfig` is made: its ``__post_init__``
calls each with the values it checks, in the order it always checked them (so of several
wrong settings the same one is named first), before the engine's own check. Each function
takes plain values (no config: this module does not import ``config.py``), raises
:class:`~kvserver.errors.InvalidArgument` naming the setting at the first that is wrong, and
changes nothing. No I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from kvserver.crypto import MAX_TOKEN_BYTES, is_loopback
from kvserver.daemon.tenants import Tenant
from kvserver.engine.types import EngineConfig
from kvserver.errors import InvalidArgument

#: the listeners' port settings, in the order they are checked: gRPC and ZMQ (0 = ephemeral),
#: then those that may be off (-1): the KV-event PUB, /metrics and the peer stream
LISTENERS = ("grpc_port", "zmq_port", "pub_port", "metrics_port", "peer_stream_port")
#: the most ``max_lease_s`` may be: a day, as a TTL pin's (a lease is a reservation or pin a
#: client has not completed, never meant to last).
MAX_MAX_LEASE_S = EngineConfig().max_pin_ttl_s
#: ``peer_stream_window``'s bounds (its default is ``config.DEFAULT_PEER_STREAM_WINDOW``).
PEER_STREAM_WINDOW_MIN = 1 << 20
PEER_STREAM_WINDOW_MAX = 1 << 30


def check_ports(ports: Mapping[str, int]) -> None:
    """``ports``: each of :data:`LISTENERS` -> its port, in that order. Each in range, and no
    two listeners on one fixed port (0: any, -1: off)."""
    for name in ("grpc_port", "zmq_port"):
        port = ports[name]
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"{name} out of range", value=port)
    for name in ("pub_port", "metrics_port", "peer_stream_port"):
        if not -1 <= ports[name] <= 65535:
            raise InvalidArgument(f"{name} out of range", value=ports[name])
    fixed: dict[int, str] = {}  # two listeners cannot share a port (0: any, -1: off)
    for name, port in ports.items():
        if port > 0 and fixed.setdefault(port, name) != name:
            raise InvalidArgument(
                f"{fixed[port]} and {name} are the same port; give each its own",
                value=port,
            )


def check_leases(default_lease_s: float, max_lease_s: float, zmq_send_timeout_s: float) -> None:
    """``default_lease_s``, ``max_lease_s`` and ``zmq_send_timeout_s``, each alone and against
    each other, in the operator's words (before the engine's own check)."""
    if not 0 < default_lease_s < math.inf:
        raise InvalidArgument("default_lease_s must be positive", value=default_lease_s)
    if not 0 < max_lease_s <= MAX_MAX_LEASE_S:
        raise InvalidArgument(
            f"max_lease_s must be positive and at most {MAX_MAX_LEASE_S:.0f} (a day)",
            value=max_lease_s,
        )
    if default_lease_s > max_lease_s:
        raise InvalidArgument(
            f"default_lease_s ({default_lease_s:g} s) is longer than max_lease_s "
            f"({max_lease_s:g} s): lower --default-lease-s or raise --max-lease-s"
        )
    if not 0 <= zmq_send_timeout_s <= max_lease_s / 2:
        raise InvalidArgument(
            f"zmq_send_timeout_s must be in [0, {max_lease_s / 2:g}], at most half "
            "the longest lease (0: the default, 60 s or that half when less)",
            value=zmq_send_timeout_s,
        )


def check_access(
    *,
    host: str,
    insecure_remote: bool,
    no_auth: bool,
    auth_token: str,
    tenants: Sequence[Tenant],
    tls_cert_file: str,
    tls_key_file: str,
    tls_client_ca_file: str,
    peer_tls_server_name: str,
    peer_tls_ca: str,
    curve_secret_key_file: str,
    curve_clients_dir: str,
) -> None:
    """Who may connect and how: the token against ``no_auth`` and the tenants, TLS's and
    CURVE's files that go together, and a ``host`` beyond loopback only with CURVE and TLS
    (or ``insecure_remote``). ``peer_tls_ca``: ``DaemonConfig.peer_tls_ca``."""
    if no_auth and auth_token:
        raise InvalidArgument("no_auth and auth_token contradict each other")
    if tenants and no_auth:
        raise InvalidArgument("tenants need auth: no_auth would let anyone use everything")
    if len(auth_token.encode()) > MAX_TOKEN_BYTES:  # the handshake's PLAIN password
        raise InvalidArgument(f"auth_token is over {MAX_TOKEN_BYTES} bytes")
    if auth_token and any(t.token == auth_token for t in tenants):
        raise InvalidArgument("a tenant's token is the daemon's own (admin) auth_token")
    if bool(tls_cert_file) != bool(tls_key_file):
        raise InvalidArgument("tls_cert_file and tls_key_file go together")
    if tls_client_ca_file and not tls_cert_file:
        raise InvalidArgument("tls_client_ca_file needs tls_cert_file and tls_key_file")
    if peer_tls_server_name and not peer_tls_ca:
        raise InvalidArgument("peer_tls_server_name needs peer_tls_ca_file or tls_cert_file")
    if curve_clients_dir and not curve_secret_key_file:
        raise InvalidArgument("curve_clients_dir needs curve_secret_key_file")
    if not is_loopback(host) and not insecure_remote:
        missing = [
            name
            for name, value in (
                ("curve_secret_key_file", curve_secret_key_file),
                ("tls_cert_file", tls_cert_file),
            )
            if not value
        ]
        if missing:
            raise InvalidArgument(
                f"host {host} is beyond loopback: set {' and '.join(missing)} "
                "(CURVE and TLS, docs/security.md; make keys with 'kvserver keys'), "
                "or pass --insecure-remote to send traffic in clear"
            )


def check_peers(
    *,
    peers: str,
    cluster: str,
    peer_addresses: Sequence[str],
    peer_timeout_s: float,
    peer_suspect_s: float,
    peer_connections: int,
    peer_stream_window: int,
) -> None:
    """The network tier's settings: its bounds, ``peers`` or ``cluster`` (not both), and each
    of ``peer_addresses`` (``DaemonConfig.peer_addresses``) a ``tcp://HOST:PORT``."""
    if not 0 < peer_timeout_s < math.inf:
        raise InvalidArgument("peer_timeout_s must be positive", value=peer_timeout_s)
    if not 0 <= peer_suspect_s < math.inf:
        raise InvalidArgument("peer_suspect_s must be >= 0", value=peer_suspect_s)
    if peer_connections < 1:
        raise InvalidArgument("peer_connections must be >= 1", value=peer_connections)
    if not PEER_STREAM_WINDOW_MIN <= peer_stream_window <= PEER_STREAM_WINDOW_MAX:
        raise InvalidArgument(
            "peer_stream_window must be between 1MiB and 1GiB",
            value=peer_stream_window,
        )
    if peers and cluster:
        raise InvalidArgument("peers and cluster exclude each other (the fleet names peers)")
    for address in peer_addresses:
        port = re.fullmatch(r"tcp://[^\s/]+:(\d{1,5})", address)
        if port is None or not 0 < int(port[1]) < 65536:  # ZMQ takes tcp://h:99999, and
            # the fetches from it time out for ever
            raise InvalidArgument(
                "a peer address must be tcp://HOST:PORT (port 1-65535)", peer=address
            )
