"""DataSockets: the data plane's ZMQ sockets: the context, the ROUTER requests arrive on, the
KV-event PUB with its bounds (``pub_limit.py``), their transport security and the handshake
gate, bound and closed together.

Runs in the daemon process, on its event loop, owned by
:class:`~kvserver.daemon.zmq_server.DataFrontend` (which reads and answers the ROUTER; this
class only makes, binds and closes the sockets). Not thread-safe.

Call order: ``open()`` once → the sockets are used → ``close()`` (idempotent; also after a
failed ``open``, which leaves what it made for ``close`` to close). Security: both sockets
are CURVE servers when ``curve_secret_key_file`` is set, with ZAP admitting only listed client
keys when a clients directory is; else, when a token is required, the ROUTER is a PLAIN
server whose password ZAP checks against the tokens (``zap.py``). The gate starts before the
ROUTER binds and stops before it closes; the PUB's subscriber limit watches it from when it is
bound until before it closes.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from kvserver.crypto import CurveServer
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.listening import bind_hint
from kvserver.daemon.pub_limit import SubscriberLimit, configure
from kvserver.daemon.refusals import HandshakeCounts, SubscriberCounts
from kvserver.daemon.zap import HandshakeGate
from kvserver.daemon.zmq_events import REPLAY_MAX_BATCHES
from kvserver.errors import KVServerError

#: a replay's batches (REPLAY_MAX_BATCHES) fit under the ROUTER's send high-water mark
ROUTER_SNDHWM = REPLAY_MAX_BATCHES + 100


class DataSockets:
    """See the module docstring. ``router`` and ``pub`` are None until ``open`` made them
    (``pub`` stays None when ``pub_port`` is -1) and after ``close``."""

    def __init__(self) -> None:
        self.ctx: zmq.asyncio.Context | None = None
        self.router: zmq.asyncio.Socket | None = None
        self.pub: zmq.asyncio.Socket | None = None
        self._zap: HandshakeGate | None = None  # tokens / CURVE keys at the handshake
        self._subscribers: SubscriberLimit | None = None  # the PUB's connections (pub_limit.py)

    def open(
        self,
        config: DaemonConfig,
        auth: Authenticator,
        handshakes: HandshakeCounts,
        subscribers: SubscriberCounts,
    ) -> tuple[int, int]:
        """Make and bind the ROUTER and the PUB (unless ``pub_port`` is -1); returns
        (data_port, pub_port or -1). ``handshakes`` and ``subscribers``: the service's counters
        of the ZAP gate and of the PUB's connections. Raises KVServerError when a port cannot
        be bound."""
        cfg = config
        self.ctx = zmq.asyncio.Context()
        curve = (
            CurveServer.from_file(cfg.curve_secret_key_file, cfg.curve_clients_dir)
            if cfg.curve_secret_key_file
            else None
        )
        # tokens (PLAIN) or listed CURVE keys at the handshake: before the ROUTER binds
        self._zap = HandshakeGate.start_for(self.ctx, handshakes, auth, curve)
        self.router = self.ctx.socket(zmq.ROUTER)
        if curve is not None:
            curve.apply(self.router)
        if self._zap is not None:
            self._zap.guard(self.router)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self.router.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
        data_port = _bind(self.router, cfg.host, cfg.zmq_port, "--zmq-port")
        pub_port = -1
        if cfg.pub_port >= 0:
            self.pub = self.ctx.socket(zmq.XPUB)  # a PUB whose subscriptions are read too
            if curve is not None:
                curve.apply(self.pub)
            self.pub.setsockopt(zmq.LINGER, 0)
            configure(self.pub, cfg.pub_hwm)
            pub_port = _bind(self.pub, cfg.host, cfg.pub_port, "--pub-port")
            self._subscribers = SubscriberLimit(
                self.ctx, subscribers, cfg.pub_max_subscribers, cfg.pub_max_subscribers_per_address
            )
            self._subscribers.watch(self.pub, pub_port)
        return data_port, pub_port

    def close(self) -> None:
        """Stop the handshake gate and the subscriber limit, close the sockets (linger 0) and
        the context. REQUIRES: nothing reads the ROUTER any more."""
        if self._zap is not None:
            self._zap.stop()  # (it watches the ROUTER: before the ROUTER closes)
            self._zap = None
        if self._subscribers is not None:
            self._subscribers.stop()  # (it watches the PUB: before the PUB closes)
            self._subscribers = None
        for sock in (self.router, self.pub):
            if sock is not None:
                sock.close(linger=0)
        self.router = self.pub = None
        if self.ctx is not None:
            self.ctx.term()  # every socket is closed: returns at once, frees queued frames
            self.ctx = None


def _bind(sock: zmq.asyncio.Socket, host: str, port: int, flag: str) -> int:
    """Bind ``sock`` to ``host:port``; a failure names ``flag``, the option that moves it."""
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    endpoint = f"tcp://{host}:{port}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise KVServerError(f"cannot bind {endpoint}: {exc}{bind_hint(flag, exc.errno)}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(bound.rsplit(":", 1)[1])
