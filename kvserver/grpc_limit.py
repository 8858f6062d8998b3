"""Bounds on a gRPC server's connections: how many in all, how many from one address, how long
one may sit idle or unfinished, how many calls one may carry at once.

Runs in the daemon (``kvserver.v1.KVServer``) and the scheduler (``kvserver.v1.Engine``), on
their event loop: :func:`server_options` goes to ``grpc.aio.server``; a :class:`ConnectionLimit`
is started once the server is bound (``grpc_serve.start_server``) and stopped before it stops.
Not thread-safe: loop only (gRPC's own threads close the connections it reads here; see
:mod:`kvserver.foreign_sockets` for why that race is harmless).

Why: gRPC has no cap on a server's connections. An idle HTTP/2 connection (the client preface,
an empty SETTINGS, then nothing) costs the daemon a descriptor and ~14 KB: 4,000 of them from
one address took it from 134 to 187 MB and 43 to 4,043 descriptors, and under a soft limit of
1,024 descriptors (a common default) 2,000 of them used every descriptor the daemon had — no
SSD file, no ZMQ or local-channel client, no peer could be opened then
(``benchmarks/grpc_idle_connections.py``, docs/benchmarks.md). So:

- **All connections**: at most :func:`max_connections` (:data:`MAX_CONNECTIONS`, or half the
  process's soft limit on descriptors if less; ``grpc.max_allowed_incoming_connections``: gRPC
  closes one accepted past it at once). The hard bound on descriptors and memory, whoever
  holds them.
- **Per address**: at most ``per_address`` (:data:`MAX_CONNECTIONS_PER_ADDRESS`; the daemon's
  setting ``grpc_max_connections_per_address``, the scheduler's flag
  ``--grpc-max-connections-per-address``) from one address, as for the KV-event PUB
  (``daemon/pub_limit.py``), the peer stream and ``/metrics``. gRPC offers no hook on accept, so
  every :data:`CHECK_EVERY_S` the process's descriptors are read (``/proc/self/fd``: a
  ``readlink`` each; each socket's addresses read once, by its inode) and an address holding
  more than ``per_address`` connections to the port has the rest shut down (the highest inodes,
  mostly the newest: the kernel numbers sockets in per-CPU batches; ``shutdown(2)``: gRPC sees
  their end and drops them), counted in :attr:`ConnectionLimit.refused`. After a cut the next
  check comes in :data:`RECHECK_AFTER_CUT_S`, so one address reconnecting holds past its share
  at most that long, and never more than ``max_connections`` in all. Reading ``/proc/net/tcp``
  instead took 100 ms a read on a host with 17,000 TCP sockets; the descriptors of one process
  are ``max_connections`` at most. Without ``/proc`` (not Linux) only the total is bounded.
- **Idle**: a connection with no call for :data:`MAX_IDLE_MS` is sent GOAWAY and closed
  (``grpc.max_connection_idle_ms``; a client's channel reconnects at its next call). A
  streaming call (WatchEvents, Generate) keeps its connection busy, not idle.
- **Handshake**: a connection that has not finished its TLS/HTTP/2 handshake in
  :data:`HANDSHAKE_TIMEOUT_MS` is closed (``grpc.server_handshake_timeout_ms``, gRPC's default
  120 s).
- **Calls**: at most :data:`MAX_CONCURRENT_STREAMS` calls at once on one connection
  (``grpc.max_concurrent_streams``; a client queues its calls past it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time

from kvserver.foreign_sockets import connection, shut_down

logger = logging.getLogger(__name__)

#: default of the most connections a server holds (gRPC closes one accepted past it).
MAX_CONNECTIONS = 1024
#: default of the most connections one address may hold.
MAX_CONNECTIONS_PER_ADDRESS = 64
#: a connection with no call this long is closed (GOAWAY).
MAX_IDLE_MS = 10 * 60 * 1000
#: a connection must finish its handshake within this.
HANDSHAKE_TIMEOUT_MS = 10 * 1000
#: the most calls at once on one connection.
MAX_CONCURRENT_STREAMS = 1024
#: how often the connections per address are counted.
CHECK_EVERY_S = 0.5
#: the next count after one that cut connections (an address reconnecting as fast as it can).
RECHECK_AFTER_CUT_S = 0.05
#: least time between two warnings about refused connections.
WARN_EVERY_S = 10.0

_FD_DIR = "/proc/self/fd"
#: cached for a socket that is not a connection to the port (or cannot be read)
_OTHER = ("", -1)


def max_connections() -> int:
    """:data:`MAX_CONNECTIONS`, or half the process's soft limit on descriptors if that is less
    (a server at its limit can open nothing else: files, other sockets), but at least 64."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return min(MAX_CONNECTIONS, max(64, soft // 2))


def server_options(max_connections: int) -> list[tuple[str, int]]:
    """The ``grpc.aio.server`` options of the bounds above (all but the per-address one)."""
    return [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", MAX_IDLE_MS),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    ]


class ConnectionLimit:
    """Keeps at most ``per_address`` connections to TCP ``port`` of this process from one
    address (see the module docstring). ``what`` names the server in its warnings.

    Invariant: ``_known`` maps the inode of every socket seen at the last check to its
    (peer host, local port), or to ``_OTHER`` for one that is not a TCP connection."""

    def __init__(self, port: int, per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                 what: str = "gRPC") -> None:  # fmt: skip
        self.port = port
        self.per_address = per_address
        self.what = what
        #: connections shut down so far
        self.refused = 0
        self._known: dict[int, tuple[str, int]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned_at = -WARN_EVERY_S
        self._warned_count = 0

    def start(self) -> None:
        """Count from now on, on the running loop (nothing without ``/proc/self/fd``)."""
        if not os.path.isdir(_FD_DIR):
            logger.info("%s: no %s, connections per address not bounded", self.what, _FD_DIR)
            return
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(CHECK_EVERY_S, self._tick)

    def stop(self) -> None:
        """Stop counting. Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None

    def _tick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            cut = self.check()
        except OSError as exc:  # /proc unreadable now: try again later
            logger.warning("%s: connections could not be counted: %s", self.what, exc)
            cut = 0
        self._timer = loop.call_later(RECHECK_AFTER_CUT_S if cut else CHECK_EVERY_S, self._tick)

    def check(self) -> int:
        """One count: shut down the connections past ``per_address`` of every address (the
        highest inodes); returns how many."""
        by_address: dict[str, list[tuple[int, int]]] = {}
        known: dict[int, tuple[str, int]] = {}
        for name in os.listdir(_FD_DIR):
            fd = int(name)
            try:
                link = os.readlink(f"{_FD_DIR}/{name}")
            except OSError:  # closed meanwhile (gRPC's threads close connections)
                continue
            if not link.startswith("socket:["):
                continue
            inode = int(link[8:-1])
            seen = self._known.get(inode)
            if seen is None:  # a new socket: read once (if ``fd`` still is it)
                found = connection(fd, inode)
                seen = _OTHER if found is None else (found.host, found.local_port)
            known[inode] = seen
            if seen[1] == self.port:
                by_address.setdefault(seen[0], []).append((inode, fd))
        self._known = known
        cut = 0
        for address, conns in by_address.items():
            if len(conns) <= self.per_address:
                continue
            conns.sort()  # inodes grow as sockets are made (per-CPU batches): mostly newest last
            # gRPC may close ``fd`` meanwhile and the number be reused: only socket ``inode``
            # can be cut (foreign_sockets.py)
            ended = sum(shut_down(fd, inode=inode) for inode, fd in conns[self.per_address :])
            cut += ended
            self._warn(address, ended)
        self.refused += cut
        return cut

    def _warn(self, address: str, cut: int) -> None:
        self._warned_count += cut
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            logger.warning(
                "%s port %d: %d connections shut down (%s held more than %d, the most one "
                "address may)", self.what, self.port, self._warned_count, address,
                self.per_address,
            )  # fmt: skip
            self._warned_at, self._warned_count = now, 0
