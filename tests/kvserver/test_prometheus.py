"""kvserver.prometheus's /metrics listener under slowloris: its real HTTP server on loopback
(the daemon's and the scheduler's), a trivial collector."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvserver.prometheus import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    REQUEST_DEADLINE_S,
    serve_metrics,
)
from tests.support.daemon import wait_until


class _One(Collector):
    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvserver_test_gauge", "A gauge.", value=1.0)


@contextlib.contextmanager
def listening(idle_timeout_s: float) -> Iterator[int]:
    port, server = serve_metrics(
        _One(), "127.0.0.1", 0, idle_timeout_s=idle_timeout_s, max_connections=4
    )
    assert server is not None
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return bytes(reply.read())


def half_request(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
    return sock


def test_the_defaults_bound_threads_and_idle_time() -> None:
    assert 0 < IDLE_TIMEOUT_S <= 30 and 0 < MAX_CONNECTIONS <= 256


def test_idle_connections_are_closed_and_their_threads_end() -> None:
    """Connections that send half a request line and wait: each held a thread of the process
    for ever. Now closed after the idle timeout; scrapes are served during and after."""
    threads = threading.active_count()
    with listening(idle_timeout_s=0.5) as port:
        idle = [half_request(port) for _ in range(3)]
        try:
            assert b"kvserver_test_gauge 1.0" in scrape(port)
            for sock in idle:
                assert sock.recv(1) == b""  # closed by the server (the socket waits 10 s)
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: threading.active_count() <= threads + 1)  # + serve_forever's
        assert b"kvserver_test_gauge 1.0" in scrape(port)


def test_connections_past_the_limit_are_closed_at_once() -> None:
    threads = threading.active_count()
    with listening(idle_timeout_s=30) as port:
        idle = [half_request(port) for _ in range(4)]
        try:
            wait_until(lambda: threading.active_count() >= threads + 1 + 4)  # each in a thread
            extra = socket.create_connection(("127.0.0.1", port), timeout=10)
            started = time.monotonic()
            assert extra.recv(1) == b""
            assert time.monotonic() - started < 5  # at once, not after the 30 s idle timeout
            extra.close()
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: _served(port))


def _served(port: int) -> bool:
    try:
        return b"kvserver_test_gauge" in scrape(port)
    except OSError:  # the closed connections' threads have not ended yet
        return False


def test_connections_that_drip_a_byte_at_a_time_are_closed_at_their_deadline() -> None:
    """Slow drip: 4 connections (the limit) each send one byte of a header line every 0.2 s,
    so the idle timeout (0.5 s) never fires: they held every slot for as long as they
    dripped (100 header lines of 64 KiB at a byte each: days), and every scrape was closed
    unanswered. A connection now has REQUEST_DEADLINE_S in all: past it it is closed, and
    scrapes are served again while the drippers go on."""
    port, server = serve_metrics(
        _One(), "127.0.0.1", 0, idle_timeout_s=0.5, max_connections=4, request_deadline_s=2.0
    )
    assert server is not None
    stop = threading.Event()
    closed = [False] * 4

    def drip(i: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            while not stop.wait(0.2):
                try:
                    sock.sendall(b"a")
                except OSError:
                    closed[i] = True
                    return

    drippers = [threading.Thread(target=drip, args=(i,)) for i in range(4)]
    try:
        for t in drippers:
            t.start()
        wait_until(lambda: all(closed), timeout=10.0)
        wait_until(lambda: _served(port), timeout=10.0)
    finally:
        stop.set()
        for t in drippers:
            t.join()
        server.shutdown()
        server.server_close()
    assert 0 < REQUEST_DEADLINE_S <= 60


def test_one_address_cannot_hold_every_connection() -> None:
    """One address holding half-sent requests took every slot (64 by default) and every
    scrape was refused. Now at most MAX_CONNECTIONS_PER_ADDRESS from one address: one more from
    it is closed at once, and a scraper at another address (127.0.0.2) is served."""
    port, server = serve_metrics(_One(), "127.0.0.1", 0, idle_timeout_s=30, max_connections=32)
    assert server is not None
    held = [half_request(port) for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
    try:
        wait_until(lambda: not _served(port))  # 127.0.0.1 holds all it may
        with socket.create_connection(("127.0.0.1", port), 10,
                                      source_address=("127.0.0.2", 0)) as other:  # fmt: skip
            other.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            reply = b""
            while chunk := other.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 200") and b"kvserver_test_gauge 1.0" in reply
    finally:
        for sock in held:
            sock.close()
        server.shutdown()
        server.server_close()
