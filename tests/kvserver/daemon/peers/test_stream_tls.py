"""The peer stream over TLS (``docs/wire.md`` §6, "TLS"): a daemon with TLS certificates opens
a TLS stream port, never a plain one; its peers dial it with TLS, check its certificate
against their CA and its name against the address, and send the token's hello inside TLS.

The serving side is a real ``kvserver start`` on loopback with certificates made by
``kvserver.crypto.make_tls_cert`` (as ``kvserver keys tls`` makes them); the fetching side is
the network tier's own classes over a real storage engine (as in ``test_stream.py``). Raw
sockets stand in for a plain client at a TLS port and for a TLS client with a wrong token.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver import wire_stream
from kvserver.client import KVClient
from kvserver.crypto import TlsClient, make_tls_cert
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.daemon.peers.link import stream_address_from
from kvserver.engine import StorageEngine
from tests.kvserver.builders import make_keys, pattern
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes
from tests.kvserver.daemon.peers.test_stream import killed_mid_fetch, no_reservations
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

TOKEN = "peer-stream-tls-token-0123456789"
KEYS = make_keys(4, tag="tls-served")


class Certs:
    """The fleet's certificate (for 127.0.0.1), another one nobody trusts, and one that
    names only the service ``kvserver-fleet``."""

    def __init__(self, root: Path) -> None:
        self.fleet = make_tls_cert(str(root / "fleet"), "fleet", ["127.0.0.1"])
        self.rogue = make_tls_cert(str(root / "rogue"), "rogue", ["127.0.0.1"])
        self.named = make_tls_cert(str(root / "named"), "named", ["kvserver-fleet"])


def tls_args(cert: tuple[str, str], *extra: str) -> tuple[str, ...]:
    return ("--tls-cert-file", cert[0], "--tls-key-file", cert[1], *extra)


def start_holding(root: Path, *args: str, token: str = TOKEN) -> DaemonProc:
    """A daemon with ``token`` ("": its own, left in its token files), holding KEYS of SPEC."""
    d = start_daemon(root, "--dram", "8MiB", *(("--auth-token", token) if token else ()), *args)
    try:
        with KVClient(d.zmq_address, colocated=False, auth_token=token) as kv:
            kv.register_namespace(SPEC)
            parts = [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in KEYS]
            assert kv.put(SPEC.ns_id, KEYS, parts).stored == KEYS
    except BaseException:
        d.kill()
        raise
    return d


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[DaemonProc]:
    """A daemon with the fleet's certificate (so its stream port is TLS) and KEYS."""
    d = start_holding(tmp_path_factory.mktemp("tls-a"), *tls_args(certs.fleet))
    yield d
    d.kill()


def tls_address(d: DaemonProc, host: str = "127.0.0.1") -> str:
    assert d.info["peer_stream_tls"] is True
    return f"tls://{host}:{d.info['peer_stream_port']}"


def context(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    return TlsClient(ca, *(cert or ("", ""))).ssl_context()


def fetcher(engine: StorageEngine, **settings: Any) -> tuple[PeerFetches, PeerBook]:
    base = {"timeout_s": 5.0, "auth_token": TOKEN, "suspect_s": 60}
    book = PeerBook(PeerSettings(**(base | settings)))
    return PeerFetches(engine, book, publish=lambda: None), book


async def fetch_from(d: DaemonProc, address: str | None, **settings: Any) -> tuple[bool, Any]:
    """Fetch KEYS from ``d`` at ``address`` (None: asked through its ``hello``, as a
    configured peer); (whether B now holds exactly A's bytes, B's counters)."""
    with engine_b() as engine:
        fetches, book = fetcher(engine, **settings)
        peer = Peer("A", "", d.zmq_address, address)
        start = time.monotonic()
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in KEYS], {"A": peer})
        assert time.monotonic() - start < 4.0  # a refusal is quick, never a hang
        held = engine.lookup(SPEC.ns_id, KEYS)
        same = held == 4 and held_bytes(engine, KEYS) == expected(KEYS)
        if held == 0:
            assert book.is_suspect("A")
        no_reservations(engine)
        await book.close()
        return same, book.counters


def stream_stats(d: DaemonProc) -> dict[str, Any]:
    with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN) as kv:
        stats: dict[str, Any] = kv.stats()["peer_stream"]
        return stats


def still_serving(d: DaemonProc, ca: str) -> None:
    """A TLS client with the token gets A's bytes on a new connection."""
    with tls_raw(d, ca) as sock:
        sock.sendall(wire_stream.encode_hello(TOKEN))
        sock.sendall(wire_stream.encode_request(wire_stream.FetchRequest(7, SPEC.ns_id, KEYS)))
        head = wire_stream.decode_reply_head(exactly(sock, wire_stream.REPLY_HEAD.size))
        assert head.ok and (head.count, head.tp) == (4, 2)
        body = exactly(sock, head.count * head.tp * head.part_bytes)
        assert body == b"".join(p for row in expected(KEYS) for p in row)


def tls_raw(d: DaemonProc, ca: str) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", d.info["peer_stream_port"]), 5)
    raw.settimeout(10)
    return context(ca).wrap_socket(raw, server_hostname="127.0.0.1")


def exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        assert got, "the daemon closed the connection"
        buf += got
    return buf


# ----------------------------------------------------------------------------- serving


def test_a_tls_daemon_announces_its_stream_as_tls_only(served: DaemonProc) -> None:
    """``hello`` names the port only as ``peer_stream_tls_port`` (an older daemon reads
    ``peer_stream_port`` and would dial it in clear), and the address it yields is tls://."""
    with KVClient(served.zmq_address, colocated=False, auth_token=TOKEN) as kv:
        hello = kv.hello()
    assert hello["peer_stream_port"] is None
    assert hello["peer_stream_tls_port"] == served.info["peer_stream_port"] > 0
    assert stream_address_from(served.zmq_address, hello) == tls_address(served)
    assert stream_stats(served)["tls"] is True


async def test_a_fetch_over_the_tls_stream_places_the_peers_bytes(
    served: DaemonProc, certs: Certs
) -> None:
    sent = stream_stats(served)["sent_chunks"]
    same, c = await fetch_from(served, tls_address(served), stream_tls=context(certs.fleet[0]))
    assert same
    assert (c.fetches, c.stream_fetches, c.fetched_chunks, c.failures) == (1, 1, 4, 0)
    assert stream_stats(served)["sent_chunks"] == sent + 4


async def test_an_idle_tls_connection_is_kept_and_used_for_the_next_fetch(
    served: DaemonProc, certs: Certs
) -> None:
    """Two fetches one after the other share one TLS connection (the idle one is checked
    alive on the raw socket, not through TLS)."""
    with engine_b() as engine:
        fetches, book = fetcher(engine, stream_tls=context(certs.fleet[0]))
        peer = Peer("A", "", served.zmq_address, tls_address(served))
        for part in (KEYS[:2], KEYS[2:]):
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in part], {"A": peer})
        assert held_bytes(engine, KEYS) == expected(KEYS)
        stream = await book.link(peer).stream()
        assert stream is not None and stream.connections_open == 1
        assert (book.counters.stream_fetches, book.counters.failures) == (2, 0)
        no_reservations(engine)
        await book.close()


async def test_a_configured_peer_is_asked_its_hello_and_fetched_over_tls(
    served: DaemonProc, certs: Certs
) -> None:
    same, c = await fetch_from(served, None, stream_tls=context(certs.fleet[0]))
    assert same and (c.fetches, c.stream_fetches) == (1, 1)


async def test_a_loopback_peer_s_own_token_is_read_from_its_token_file(
    tmp_path: Path, certs: Certs
) -> None:
    """No token configured on either side: the fetcher reads the peer's token file for its
    TLS stream port (``tls://`` addresses are looked up by port as ``tcp://`` ones are)."""
    a = start_holding(tmp_path / "own-token", *tls_args(certs.fleet), token="")
    try:
        same, c = await fetch_from(a, tls_address(a), stream_tls=context(certs.fleet[0]),
                                   auth_token="")  # fmt: skip
        assert same and (c.stream_fetches, c.failures) == (1, 0)
    finally:
        a.kill()


async def test_a_peer_whose_certificate_is_not_trusted_is_refused(
    served: DaemonProc, certs: Certs
) -> None:
    """B trusts another CA: the handshake fails, every chunk misses, the peer is suspect,
    nothing is reserved, and A keeps serving everyone else."""
    refused = stream_stats(served)["refused_handshakes"]
    same, c = await fetch_from(served, tls_address(served), stream_tls=context(certs.rogue[0]))
    assert not same
    assert (c.failures, c.timeouts, c.missed_chunks, c.placed_chunks) == (1, 0, 4, 0)
    assert stream_stats(served)["refused_handshakes"] == refused + 1
    still_serving(served, certs.fleet[0])


async def test_a_plain_fetcher_at_a_tls_port_fails_cleanly(
    served: DaemonProc, certs: Certs
) -> None:
    """A fleet record that lies (tcp:// for the TLS port): the hello is no TLS handshake,
    the connection closes, the chunks miss."""
    address = tls_address(served).replace("tls://", "tcp://")
    same, c = await fetch_from(served, address)
    assert not same and c.failures + c.timeouts == 1 and c.placed_chunks == 0
    still_serving(served, certs.fleet[0])


def test_a_plain_hello_at_a_tls_port_gets_no_stream_reply(served: DaemonProc, certs: Certs) -> None:
    refused = stream_stats(served)["refused_handshakes"]
    with socket.create_connection(("127.0.0.1", served.info["peer_stream_port"]), 5) as sock:
        sock.settimeout(10)
        rest = b""
        try:  # the daemon may reset the connection while these are still being sent
            sock.sendall(wire_stream.encode_hello(TOKEN))
            sock.sendall(wire_stream.encode_request(wire_stream.FetchRequest(1, SPEC.ns_id, KEYS)))
            while chunk := sock.recv(1 << 16):
                rest += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    assert wire_stream.REPLY_MAGIC not in rest and len(rest) < 64  # at most a TLS alert
    assert stream_stats(served)["refused_handshakes"] == refused + 1
    still_serving(served, certs.fleet[0])


def test_a_wrong_token_inside_tls_is_refused(served: DaemonProc, certs: Certs) -> None:
    """The hello is read inside TLS, as on a plain port: a wrong token is answered
    ``unauthenticated`` (id 0) and the connection closed."""
    with tls_raw(served, certs.fleet[0]) as sock:
        sock.sendall(wire_stream.encode_hello("not-the-token"))
        head = wire_stream.decode_reply_head(exactly(sock, wire_stream.REPLY_HEAD.size))
        assert not head.ok and head.request_id == 0
        assert wire_stream.decode_error(exactly(sock, head.count)).code == "unauthenticated"
        assert sock.recv(1) == b""
    still_serving(served, certs.fleet[0])


# ----------------------------------------------------------------------------- fetching


async def test_a_tls_port_is_never_dialled_in_clear_and_its_chunks_come_over_zmq(
    served: DaemonProc,
) -> None:
    """B has no CA for its peers' certificates: a tls:// record is not dialled at all (no
    plain fallback on that port); the chunks come over ZMQ, byte for byte."""
    same, c = await fetch_from(served, tls_address(served))
    assert same and (c.fetches, c.stream_fetches, c.failures) == (1, 0, 0)


async def test_a_curve_fetcher_uses_a_tls_stream_but_never_a_plain_one(
    tmp_path: Path, served: DaemonProc, certs: Certs
) -> None:
    """``stream=False`` (this daemon has CURVE: no chunk may cross in clear) keeps the TLS
    stream, and a plain peer's chunks come over ZMQ."""
    same, c = await fetch_from(
        served, tls_address(served), stream=False, stream_tls=context(certs.fleet[0])
    )
    assert same and c.stream_fetches == 1
    plain = start_holding(tmp_path / "plain")
    try:
        port = plain.info["peer_stream_port"]
        same, c = await fetch_from(plain, f"tcp://127.0.0.1:{port}", stream=False,
                                   stream_tls=context(certs.fleet[0]))  # fmt: skip
        assert same and (c.fetches, c.stream_fetches) == (1, 0)
    finally:
        plain.kill()


async def test_a_tls_fetcher_at_a_plain_port_fails_cleanly(tmp_path: Path, certs: Certs) -> None:
    """A record that lies the other way (tls:// for a plain port): the plain server takes
    the ClientHello for a bad hello, the handshake fails, the chunks miss; the plain daemon
    keeps serving."""
    plain = start_holding(tmp_path / "plain")
    try:
        address = f"tls://127.0.0.1:{plain.info['peer_stream_port']}"
        same, c = await fetch_from(plain, address, stream_tls=context(certs.fleet[0]))
        assert not same and c.failures + c.timeouts == 1 and c.placed_chunks == 0
        assert stream_stats(plain)["refused_hellos"] == 1
        port = plain.info["peer_stream_port"]
        same, _ = await fetch_from(plain, f"tcp://127.0.0.1:{port}")
        assert same
    finally:
        plain.kill()


async def test_the_certificate_must_name_the_address_or_the_configured_name(
    tmp_path: Path, certs: Certs
) -> None:
    """A certificate for the service name only (as deploy/k8s makes it) is refused for the
    peer's IP address, and accepted with ``peer_tls_server_name`` set to that name."""
    a = start_holding(tmp_path / "named", *tls_args(certs.named))
    try:
        ctx = context(certs.named[0])
        same, c = await fetch_from(a, tls_address(a), stream_tls=ctx)
        assert not same and c.failures == 1
        same, c = await fetch_from(a, tls_address(a), stream_tls=ctx,
                                   tls_server_name="kvserver-fleet")  # fmt: skip
        assert same and c.stream_fetches == 1
    finally:
        a.kill()


async def test_mutual_tls_requires_the_fetchers_certificate(tmp_path: Path, certs: Certs) -> None:
    """A daemon configured for client certificates (``--tls-client-ca-file``, as on gRPC)
    serves a fetcher presenting the fleet's certificate and refuses one presenting none or
    an untrusted one."""
    a = start_holding(tmp_path / "mtls", *tls_args(certs.fleet, "--tls-client-ca-file",
                                                     certs.fleet[0]))  # fmt: skip
    try:
        ca = certs.fleet[0]
        same, c = await fetch_from(a, tls_address(a), stream_tls=context(ca, certs.fleet))
        assert same and c.stream_fetches == 1
        for cert in (None, certs.rogue):
            same, c = await fetch_from(a, tls_address(a), stream_tls=context(ca, cert))
            assert not same and c.failures + c.timeouts == 1 and c.placed_chunks == 0
        assert stream_stats(a)["refused_handshakes"] == 2
    finally:
        a.kill()


def test_a_daemon_with_curve_and_tls_opens_a_tls_port(tmp_path: Path) -> None:
    """``--keys-dir`` (CURVE, TLS and a token): the stream port is TLS, announced so."""
    d = start_daemon(tmp_path / "d", "--dram", "8MiB", "--keys-dir", str(tmp_path / "keys"))
    try:
        assert d.info["peer_stream_port"] > 0 and d.info["peer_stream_tls"] is True
    finally:
        d.kill()


def test_the_peers_ca_defaults_to_the_daemons_own_certificate_and_a_name_needs_one() -> None:
    from kvserver.daemon.config import DaemonConfig
    from kvserver.errors import InvalidArgument

    mine = DaemonConfig(tls_cert_file="/c.crt", tls_key_file="/c.pem")
    assert mine.peer_tls_ca == "/c.crt"
    assert mine.replace(peer_tls_ca_file="/ca.crt").peer_tls_ca == "/ca.crt"
    assert DaemonConfig().peer_tls_ca == ""
    with pytest.raises(InvalidArgument, match="peer_tls_server_name needs"):
        DaemonConfig(peer_tls_server_name="kvserver")
    DaemonConfig(peer_tls_server_name="kvserver", peer_tls_ca_file="/ca.crt")


def test_tls_files_that_cannot_be_used_are_errors_naming_them(tmp_path: Path) -> None:
    from kvserver.crypto import TlsServer
    from kvserver.errors import InvalidArgument

    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate")
    with pytest.raises(InvalidArgument, match=r"bad\.crt"):
        TlsClient(str(bad)).ssl_context()
    with pytest.raises(InvalidArgument, match=r"missing\.crt"):
        TlsServer(str(tmp_path / "missing.crt"), str(bad)).ssl_context()
    with pytest.raises(InvalidArgument, match=r"bad\.crt"):
        TlsServer(str(bad), str(bad)).ssl_context()


# ----------------------------------------------------------------------------- failures mid-reply


def big_holder(root: Path, certs: Certs, *extra: str) -> tuple[DaemonProc, Any, list[bytes]]:
    """A TLS daemon holding 64 chunks of 1 MiB (64 MiB: 2 windows of the stream), and KEYS."""
    from tests.kvserver.builders import make_spec

    spec = make_spec(model="test/tls-big", part_bytes_override=1 << 20)
    d = start_daemon(root, "--dram", "80MiB", "--auth-token", TOKEN, *tls_args(certs.fleet),
                     *extra)  # fmt: skip
    keys = make_keys(64, tag="tls-big")
    try:
        with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN) as kv:
            kv.register_namespace(spec)
            for i in range(0, 64, 8):
                chunk = keys[i : i + 8]
                data = [pattern(k, 0, spec.part_bytes) for k in chunk]
                assert kv.put(spec.ns_id, chunk, data).stored == chunk
            kv.register_namespace(SPEC)
            parts = [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in KEYS]
            assert kv.put(SPEC.ns_id, KEYS, parts).stored == KEYS
    except BaseException:
        d.kill()
        raise
    return d, spec, keys


async def test_a_tls_peer_killed_mid_fetch_is_a_bounded_miss_with_nothing_reserved(
    tmp_path: Path, certs: Certs
) -> None:
    """As over a plain stream: A is stopped once the first reply has begun, then SIGKILLed;
    the receiving thread's TLS read ends (socket shut down or timed out), the windows that
    arrived whole are placed byte for byte, the rest misses, nothing stays reserved."""

    from tests.kvserver.builders import make_engine

    a, spec, keys = big_holder(tmp_path / "a", certs)
    try:
        with make_engine(num_pages=96, page_size=1 << 20) as engine:
            engine.register_namespace(spec)
            fetches, book = fetcher(engine, timeout_s=1.0, stream_tls=context(certs.fleet[0]))
            peer = Peer("A", "", a.zmq_address, tls_address(a))
            await killed_mid_fetch(engine, fetches, book, spec, keys, a, peer)
    finally:
        a.kill()


def test_a_tls_reader_that_stops_reading_is_cut_off_and_its_pins_end(
    tmp_path: Path, certs: Certs
) -> None:
    """A TLS client asks for 64 MiB and reads nothing: the daemon's sending thread is bounded
    by the peer timeout, the connection closes, the reply's pins end, and others are served
    meanwhile and after."""
    a, spec, keys = big_holder(tmp_path / "a", certs, "--peer-timeout-s", "1")
    try:
        with tls_raw(a, certs.fleet[0]) as sock:
            sock.sendall(wire_stream.encode_hello(TOKEN))
            sock.sendall(wire_stream.encode_request(wire_stream.FetchRequest(1, spec.ns_id, keys)))

            def pins() -> int:
                with KVClient(a.zmq_address, colocated=False, auth_token=TOKEN) as kv:
                    return int(kv.stats()["num_leases"])

            from tests.support.daemon import wait_until

            wait_until(lambda: pins() == 1, timeout=10)  # the reply is being sent
            still_serving(a, certs.fleet[0])  # on another connection, meanwhile
            wait_until(lambda: pins() == 0, timeout=10)  # cut off after the timeout
        still_serving(a, certs.fleet[0])
    finally:
        a.kill()
