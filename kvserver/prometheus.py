"""Prometheus exposition shared by the daemon and the scheduler (``/metrics``, text format).

Runs in the daemon and the scheduler processes. prometheus_client's HTTP server answers
scrapes on a thread of its own; everything the metrics describe lives on the process's event
loop, which is not thread-safe. So a :class:`LoopCollector` takes its snapshot *on the loop*
(``call_soon_threadsafe``; the scrape thread waits at most :data:`SNAPSHOT_TIMEOUT_S`) and turns
it into metric families on the scrape thread. Counters are the owners' existing counters, read
at scrape time, never copies kept in step. Latency histograms (:func:`latency_histogram`) are
prometheus_client ``Histogram`` objects (thread-safe) observed on the loop and collected here.

Call order: build the collectors → :func:`serve_metrics` (returns the bound port, or -1 if the
listener could not be opened: metrics are not the service, so that is logged, not fatal) →
``server.shutdown()`` at exit.

The listener is unauthenticated (figures, no KV) and takes a thread per connection, so it is
bounded: a connection that sends or reads nothing for :data:`IDLE_TIMEOUT_S` is closed, one
still open :data:`REQUEST_DEADLINE_S` after it was accepted is closed too, and past
:data:`MAX_CONNECTIONS` at once, or :data:`MAX_CONNECTIONS_PER_ADDRESS` from one address, a new
one is closed unanswered (one address cannot hold every slot). (prometheus_client's own
server kept an idle connection and its thread for ever: 300 connections that sent half a
request line held 300 threads of the daemon. The idle timeout alone let a connection that
sends a header byte every few seconds keep its slot for days: as many as the limit kept
every scrape out.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvserver.netaddr import host_port

logger = logging.getLogger(__name__)

#: how long a scrape waits for the event loop to take its snapshot.
SNAPSHOT_TIMEOUT_S = 5.0
#: a metrics connection idle this long (no byte sent or read) is closed.
IDLE_TIMEOUT_S = 10.0
#: metrics connections served at once (a thread each); more are closed unanswered.
MAX_CONNECTIONS = 64
#: a metrics connection still open this long after it was accepted is closed (a scrape takes
#: milliseconds; Prometheus gives up after its scrape_timeout, 10 s by default).
REQUEST_DEADLINE_S = 30.0
#: metrics connections one address may have open at once (a scraper needs one).
MAX_CONNECTIONS_PER_ADDRESS = 8
#: seconds; from 50 µs (a co-located lookup) to 10 s (an SSD promotion under load).
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


def latency_histogram(name: str, documentation: str, labels: Iterable[str] = ()) -> Histogram:
    """A latency histogram (seconds, :data:`LATENCY_BUCKETS`) in no registry: a collector of
    its owner yields it (``yield from h.collect()``)."""
    return Histogram(name, documentation, list(labels), registry=None, buckets=LATENCY_BUCKETS)


class LoopCollector(Collector):
    """A collector whose snapshot is taken on ``loop``; subclasses implement both halves.

    ``snapshot()`` runs on the loop (it may read loop-owned state); ``families(snapshot)`` runs
    on the scrape thread and must only use the snapshot and thread-safe objects.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def snapshot(self) -> Any:
        raise NotImplementedError

    def families(self, snapshot: Any) -> Iterator[Metric]:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        # Registration must not collect: it happens on the loop, which collect() waits for.
        return []

    def collect(self) -> Iterator[Metric]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def take() -> None:
            try:
                future.set_result(self.snapshot())
            except BaseException as exc:  # reported to the scrape (HTTP 500), loop unharmed
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(take)
        yield from self.families(future.result(SNAPSHOT_TIMEOUT_S))


class _Handler(WSGIRequestHandler):
    """A request handler that logs nothing and gives up on an idle connection."""

    timeout = IDLE_TIMEOUT_S  # the socket's timeout (socketserver.StreamRequestHandler)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most ``max_connections`` at once, each connection cut
    ``request_deadline_s`` after it was accepted."""

    max_connections = MAX_CONNECTIONS
    request_deadline_s = REQUEST_DEADLINE_S

    def server_activate(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._by_address: dict[str, int] = {}
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        address = _address_of(client_address)
        with self._lock:
            mine = self._by_address.get(address, 0)
            full = self._open >= self.max_connections or mine >= MAX_CONNECTIONS_PER_ADDRESS
            if not full:
                self._open += 1
                self._by_address[address] = mine + 1
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing will count it out
            self._closed(address)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(self.request_deadline_s, _cut, (request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._closed(_address_of(client_address))

    def _closed(self, address: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._by_address.get(address, 0) - 1
            if left > 0:
                self._by_address[address] = left
            else:
                self._by_address.pop(address, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # an idle connection timed out, or the client went away: not worth a traceback
        logger.debug("metrics connection from %s ended", client_address, exc_info=True)


def _address_of(client_address: Any) -> str:
    """The host part of a connection's peer address ("" when it has none)."""
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""


def _cut(request: socket.socket) -> None:
    """End a connection past its deadline: its thread's next read or write fails."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


def serve_metrics(
    collector: Collector,
    host: str,
    port: int,
    *,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
    request_deadline_s: float = REQUEST_DEADLINE_S,
) -> tuple[int, WSGIServer | None]:
    """Serve ``collector`` at ``http://host:port/metrics`` (0 = any port, -1 = off), on a
    thread of its own, closing connections idle ``idle_timeout_s`` or open
    ``request_deadline_s``, and refusing more than ``max_connections`` at once.

    Returns (bound port, server to ``shutdown()``), or (-1, None) when off or when the port
    cannot be bound (logged as an error: the process keeps serving without metrics)."""
    if port < 0:
        return -1, None
    # No ``*_created`` series: in the text format they are extra gauges nobody queries.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    # the standard process_* series (start time, CPU seconds, resident memory, open fds): what
    # a dashboard's restart and leak panels read; Linux only (nothing elsewhere)
    ProcessCollector(registry=registry)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type(
        "MetricsServer",
        (_BoundedServer,),
        {
            "address_family": family,
            "max_connections": max_connections,
            "request_deadline_s": request_deadline_s,
        },
    )
    handler_class = type("MetricsHandler", (_Handler,), {"timeout": idle_timeout_s})
    try:
        server: WSGIServer = make_server(
            host, port, make_wsgi_app(registry), server_class, handler_class=handler_class
        )
    except OSError as exc:
        logger.error("metrics not served: cannot listen on %s: %s", host_port(host, port), exc)
        return -1, None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return int(server.server_port), server
