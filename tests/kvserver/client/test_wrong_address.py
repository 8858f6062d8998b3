"""A client pointed at the wrong place says so: nothing listening, a port of the daemon that
is not its ZMQ data port, an address written without ``tcp://``. Real daemons and real
sockets; the errors are the ones an operator would read."""

from __future__ import annotations

import errno
import gc
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import uvloop
import zmq
import zmq.asyncio

from kvserver.client import AsyncKVClient, KVClient
from kvserver.client.common import ADDRESS_FORMS, DEFAULT_DATA_PORT, data_address
from kvserver.client.links import open_dealer
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument, Unavailable
from tests.support.daemon import start_daemon
from tests.support.ports import free_port

NOTHING_THERE = r"within 0\.5s: nothing accepts connections there .* is `kvserver start` running"
NOT_ZMQ = r"never began the ZMQ handshake: is that the daemon's ZMQ port\? .*--zmq-port"


def closed_port() -> int:
    """A port nobody listens on, outside the ephemeral range: a port bound to 0 and closed
    is the kernel's to hand out again, to any process's next listener or connection (the
    client's own connection could then take it: a TCP self-connect answers the handshake)."""
    return free_port()


def test_a_client_of_a_port_nobody_listens_on_is_told_nothing_accepts_there() -> None:
    """KVClient at a port with no daemon: was "no reply from ... within 0.5s" and no more."""
    with (
        KVClient(f"tcp://127.0.0.1:{closed_port()}", timeout=0.5) as kv,
        pytest.raises(Unavailable, match=NOTHING_THERE),
    ):
        kv.stats()


def test_an_asyncio_client_of_a_port_nobody_listens_on_is_told_so_too() -> None:
    async def main() -> None:
        async with AsyncKVClient(f"tcp://127.0.0.1:{closed_port()}", timeout=0.5) as kv:
            with pytest.raises(Unavailable, match=NOTHING_THERE):
                await kv.stats()

    uvloop.run(main())


@pytest.mark.multiprocess
def test_a_client_of_the_daemons_grpc_or_metrics_port_is_told_it_is_not_the_zmq_port(
    tmp_path: Path,
) -> None:
    """KVClient given the gRPC port (an HTTP/2 server: it hangs up at the ZMQ greeting) or the
    metrics port (HTTP: it waits for a request line): was a bare "no reply"."""
    d = start_daemon(tmp_path)
    try:
        for port in (d.info["grpc_port"], d.info["metrics_port"]):
            with (
                KVClient(f"tcp://127.0.0.1:{port}", timeout=1.0) as kv,
                pytest.raises(Unavailable, match=NOT_ZMQ),
            ):
                kv.stats()
        with KVClient(d.zmq_address, timeout=5.0) as kv:  # the daemon itself is fine
            assert kv.stats()["capacity_bytes"] > 0
    finally:
        assert d.terminate() == 0, d.log()


@pytest.mark.multiprocess
def test_an_address_without_tcp_reaches_the_daemon(tmp_path: Path) -> None:
    """``KVClient("127.0.0.1:PORT")``, as ``kvserver status --server`` takes its address: was
    ``zmq.ZMQError: Invalid argument`` from ``connect``."""
    d = start_daemon(tmp_path)
    try:
        with KVClient(f"127.0.0.1:{d.info['zmq_port']}", timeout=5.0) as kv:
            assert kv.stats()["capacity_bytes"] > 0
    finally:
        assert d.terminate() == 0, d.log()


@pytest.mark.parametrize(
    ("given", "endpoint"),
    [
        ("tcp://10.0.0.1:5", "tcp://10.0.0.1:5"),
        ("ipc:///run/kv", "ipc:///run/kv"),
        ("10.0.0.1:5", "tcp://10.0.0.1:5"),
        ("kvserver", f"tcp://kvserver:{DEFAULT_DATA_PORT}"),
        ("[::1]", f"tcp://[::1]:{DEFAULT_DATA_PORT}"),
        ("::1", f"tcp://[::1]:{DEFAULT_DATA_PORT}"),
        ("[::1]:5", "tcp://[::1]:5"),
    ],
)
def test_data_address_completes_what_zmq_would_refuse(given: str, endpoint: str) -> None:
    assert data_address(given) == endpoint


@pytest.mark.parametrize(
    "given",
    ["tcp://[::1]:65535", "tcp://::1:5", "tcp://kv-host.example:1", "ipc://@kvserver", "h:05"],
)
def test_data_address_passes_what_zmq_connects_to(given: str) -> None:
    """An unbracketed IPv6 host after ``tcp://`` is what a daemon with an IPv6
    ``--advertise-addr`` writes in its fleet record: ZMQ takes the port after the last
    colon, and so does the client."""
    endpoint = given if "://" in given else f"tcp://{given}"
    assert data_address(given) == endpoint


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("tcp://10.0.0.1", "no port"),
        ("tcp://10.0.0.1:", "port '' is not 1-65535"),
        ("tcp://10.0.0.1:0", "port '0' is not 1-65535"),
        ("tcp://10.0.0.1:65536", "port '65536' is not 1-65535"),
        ("tcp://10.0.0.1:99999", "port '99999' is not 1-65535"),
        ("tcp://10.0.0.1:0000009471", "port '0000009471' is not 1-65535"),
        ("tcp://10.0.0.1:abc", "port 'abc' is not 1-65535"),
        ("tcp://10.0.0.1:+5", "port '\\+5' is not 1-65535"),
        ("tcp://10.0.0.1:5/x", "port '5/x' is not 1-65535"),
        ("tcp://:9471", "no host"),
        ("tcp://*:9471", "no host"),
        ("tcp://[]:9471", "host '\\[\\]' is not an IPv6 address in brackets"),
        ("tcp://[::1:9471", "host '\\[::1' is not an IPv6 address in brackets"),
        ("tcp://::1]:9471", "host '::1\\]' is not an IPv6 address in brackets"),
        ("tcp://a b:9471", "host 'a b' is no host name or address"),
        ("tcp://h/x:9471", "host 'h/x' is no host name or address"),
        ("ipc://", "no ipc:// path"),
        ("nosuch://x", "nosuch:// is no transport of the daemon's data port"),
        ("inproc://kv", "inproc:// is no transport of the daemon's data port"),
        ("tls://10.0.0.1:5", "tls:// is no transport of the daemon's data port"),
        ("10.0.0.1:abc", "port 'abc' is not 1-65535"),
        ("10.0.0.1:0", "port '0' is not 1-65535"),
        ("[::1]:", "port '' is not 1-65535"),
        (":9471", "no host"),
    ],
)
def test_data_address_refuses_what_zmq_would_refuse_or_connect_to_for_ever(
    given: str, why: str
) -> None:
    """Each was passed to ZMQ as it was: a bare ``zmq.ZMQError`` ("Invalid argument",
    "Protocol not supported") from the first call, or (port 0, 99999, no host) a connect
    that never succeeds, so every call timed out. Now: InvalidArgument, one line, naming the
    address, what is wrong and the forms taken."""
    with pytest.raises(InvalidArgument) as raised:
        data_address(given)
    message = str(raised.value)
    assert "\n" not in message
    assert re.search(f"bad daemon address {re.escape(repr(given))}: {why}; give ", message)
    assert ADDRESS_FORMS in message


@pytest.mark.parametrize("client", ["sync", "asyncio"])
def test_a_client_of_a_bad_address_is_refused_at_construction_with_no_socket_open(
    client: str,
) -> None:
    """``KVClient("tcp://127.0.0.1")`` (no port): was constructed, and its first call raised
    a bare ``zmq.ZMQError: Invalid argument``. Now the constructor raises InvalidArgument
    before any socket exists: nothing to close, no ResourceWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InvalidArgument, match=r"bad daemon address 'tcp://127\.0\.0\.1'"):
            if client == "sync":
                KVClient("tcp://127.0.0.1", timeout=0.5)
            else:

                async def main() -> None:
                    AsyncKVClient("tcp://127.0.0.1", timeout=0.5)

                uvloop.run(main())
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def test_the_clients_default_data_port_is_the_daemons() -> None:
    assert DaemonConfig().zmq_port == DEFAULT_DATA_PORT
    with pytest.raises(InvalidArgument, match="no daemon address"):
        data_address(" ")


@pytest.mark.parametrize("address", ["tcp://127.0.0.1", "nosuch://127.0.0.1:5"])
@pytest.mark.parametrize("context", [zmq.Context, zmq.asyncio.Context], ids=["sync", "asyncio"])
def test_a_dealer_zmq_refuses_to_connect_is_closed_not_left_open(
    address: str, context: type[zmq.Context[Any]]
) -> None:
    """``open_dealer`` (both clients' DEALER; the network tier's, through AsyncKVClient) at an
    address ZMQ's connect refuses (no port, a transport ZMQ lacks; ``data_address`` refuses
    these before, but ZMQ may refuse more: a host name too long): the ZMQError is raised, and
    the DEALER and its watch's monitor socket are closed. Before: both were left open in the
    context (ResourceWarning "unclosed socket" when collected; a ``term()`` of the context
    meanwhile waited for them forever)."""
    ctx = context()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(zmq.ZMQError) as raised:
                open_dealer(ctx, address, None)
            assert raised.value.errno in (errno.EINVAL, errno.EPROTONOSUPPORT)
            del raised  # its traceback holds open_dealer's frame, so the sockets
            gc.collect()
        unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert unclosed == []
    finally:
        ctx.term()
