"""Where the daemon listens: :func:`check_ports`, a probe that its fixed ports are free before
the arena is made (``process.py``, at start-up), the start-up line (``kvserver listening:
...``, :func:`listening_line`), logged once serving: pure formatting of the config and the
ready file's ``info``, and :func:`bind_hint`, what an error says to do when a listener (the
daemon's, the scheduler's) cannot bind."""

from __future__ import annotations

import errno
import socket
from errno import EADDRINUSE

from kvserver.arena import DEFAULT_SHM_DIR
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import KVServerError
from kvserver.netaddr import host_port
from kvserver.token_file import token_dir

#: the fixed ports whose binding start-up needs, with the flag that moves each
_PORT_FLAGS = (
    ("grpc_port", "--grpc-port"),
    ("zmq_port", "--zmq-port"),
    ("pub_port", "--pub-port"),
    ("peer_stream_port", "--peer-stream-port"),
)


def bind_hint(flag: str, errno: int | None = None) -> str:
    """What to do when a listener cannot bind: the ``flag`` that moves it (``errno``
    EADDRINUSE or None: the port may be taken; else the address itself is wrong)."""
    if errno not in (None, EADDRINUSE):
        return "; check --host (an address of this machine, or 0.0.0.0 for every one)"
    return (
        f"; is another kvserver (or another program) on that port? Stop it, or choose "
        f"another with {flag} PORT (0: any free port)"
    )


def check_ports(config: DaemonConfig) -> None:
    """Raise KVServerError, naming the flag that moves it, when one of the daemon's fixed TCP
    ports (0: any, -1: off; metrics are not the service: not checked) is taken: found before
    the arena is pre-faulted (a second ``kvserver start --dram 64GiB`` committed 64 GiB more
    before it was told). A probe on each address ``--host`` resolves to, bound and closed as
    the listeners bind (SO_REUSEADDR: a port a stopped daemon's connections still wait on is
    free); the listeners' own binds still decide. An address that is not this machine's is
    ``preflight.check_host``'s to say (``localhost`` may resolve to ``::1`` first on a host
    without IPv6, where the listeners bind 127.0.0.1: that is no refusal)."""
    for name, flag in _PORT_FLAGS:
        port = int(getattr(config, name))
        if port <= 0:
            continue
        try:
            found = socket.getaddrinfo(
                config.host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except OSError:  # preflight.check_host says what is wrong with the host
            return
        for family, kind, proto, _, address in found:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue
                hint = bind_hint(flag, exc.errno)
                raise KVServerError(
                    f"cannot bind {host_port(config.host, port)}: {exc.strerror}{hint}"
                ) from None


def listening_line(config: DaemonConfig, info: dict[str, object], token: str) -> str:
    """The start-up line's body: every address (``off`` for a listener turned off), the
    tiers, who may connect and the fleet, from the ready file's ``info``. Its first fields
    (up to the DRAM arena) are stable: scripts may read them."""
    host = f"[{config.host}]" if ":" in config.host else config.host

    def at(scheme: str, key: str, path: str = "") -> str:
        port = int(str(info[key]))
        return f"{scheme}{host}:{port}{path}" if port >= 0 else "off"

    metrics = at("http://", "metrics_port", "/metrics")
    if metrics == "off" and config.metrics_port >= 0:  # asked for, but the port was refused
        metrics = f"NOT served ({host}:{config.metrics_port} could not be bound: see above)"
    parts = [
        f"gRPC {host}:{info['grpc_port']}",
        f"ZMQ data {at('tcp://', 'zmq_port')}",
        f"events {at('tcp://', 'pub_port')}",
        f"metrics {metrics}",
        f"DRAM {int(str(info['dram_bytes'])) >> 20} MiB ({config.policy}) in {info['arena_path']}",
    ]
    if int(str(info["peer_stream_port"])) >= 0:
        tls = " (TLS)" if info["peer_stream_tls"] else ""
        parts.append(f"peer stream {at('tcp://', 'peer_stream_port')}{tls}")
    if config.ssd_dir:
        parts.append(
            f"SSD {config.ssd >> 20} MiB ({config.ssd_policy}) in {config.ssd_dir}: "
            f"{info['ssd_condition'] or 'ok'}"
        )
    else:
        parts.append("no SSD tier (--ssd-dir DIR adds one)")
    if not token:
        parts.append("no auth token (--no-auth: any local user may read and write)")
    else:
        where = token_dir(config.shm_dir)
        if config.shm_dir != DEFAULT_SHM_DIR:  # the clients look in /dev/shm unless told
            where += f" when KVSERVER_SHM_DIR={config.shm_dir} is set for them"
        parts.append(f"auth token required (this user's clients find it in {where})")
    cluster = config.cluster_config()
    if cluster is not None:  # describe(): the URL without its password
        parts.append(
            f"fleet {cluster.target().describe()} as {info['cluster_host_id']}: "
            f"{info['cluster_condition']}"
        )
    elif config.peers:
        parts.append(f"peers {config.peers}")
    else:
        parts.append("standalone")
    return ", ".join(parts)
