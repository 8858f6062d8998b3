"""The peer stream (``docs/wire.md``, "Peer stream"): fetches over plain TCP, received
straight into the fetching daemon's arena.

The serving side is a real ``kvserver start`` on loopback; the fetching side is the network
tier's own classes over a real storage engine (as in ``test_fetch.py``), so the tests can look
at its DRAM and leases. Faults a real daemon cannot produce on demand (a reply cut off in the
middle, a stall, a reply of the wrong shape) come from a stand-in server on a raw socket; bad
input to the daemon's stream port is sent on raw sockets too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver import wire_stream
from kvserver.client import KVClient
from kvserver.cluster.schema import HostInfo
from kvserver.daemon.peers import fetch
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.daemon.peers.place import FETCH_CLIENT
from kvserver.engine import StorageEngine
from kvserver.engine.types import EntryState
from kvserver.errors import InvalidArgument
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_engine, make_keys, make_spec, pattern
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes, store
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.metrics import scrape

pytestmark = pytest.mark.multiprocess

TOKEN = "peer-stream-token-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """A daemon with a token, four chunks of SPEC and a tenant allowed another model only."""
    tmp = tmp_path_factory.mktemp("stream")
    config = tmp / "kvserver.toml"
    config.write_text(f'[[tenants]]\nname = "other"\ntoken = "{TENANT}"\nmodels = ["other"]\n')
    d = start_daemon(tmp / "a", "--dram", "8MiB", "--auth-token", TOKEN, "--config", str(config))
    try:
        with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN) as kv:
            kv.register_namespace(SPEC)
            parts = [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in KEYS]
            assert kv.put(SPEC.ns_id, KEYS, parts).stored == KEYS
        yield d
    finally:
        d.kill()


TENANT = "tenant-token-abcdefghijklmnop"
KEYS = make_keys(4, tag="served")


def stream_address(d: DaemonProc) -> str:
    port = d.info["peer_stream_port"]
    assert isinstance(port, int) and port > 0
    return f"tcp://127.0.0.1:{port}"


def recorded_peer(d: DaemonProc) -> Peer:
    """``d`` as the fleet index names it: its record advertises the stream."""
    return Peer("A", "", d.zmq_address, stream_address(d))


def fetcher(
    engine: StorageEngine, window: int = fetch.STREAM_WINDOW_BYTES, **settings: Any
) -> tuple[PeerFetches, PeerBook]:
    book = PeerBook(PeerSettings(**({"timeout_s": 5.0} | settings)))
    return PeerFetches(engine, book, publish=lambda: None, stream_window_bytes=window), book


def no_reservations(engine: StorageEngine) -> None:
    """Nothing of a fetch is left behind: no WRITING entry, no lease of the fetcher."""
    engine.check_invariants()
    assert not [e for e in engine.entries().values() if e.state is EntryState.WRITING]
    assert not [lease for lease in engine.leases if lease.client == FETCH_CLIENT]


async def killed_mid_fetch(
    engine: StorageEngine,
    fetches: PeerFetches,
    book: PeerBook,
    spec: NamespaceSpec,
    keys: list[bytes],
    a: DaemonProc,
    peer: Peer,
    until: str = "fetched_chunks",
    at_least: int = 1,
) -> int:
    """Fetch ``keys`` (64 chunks, rank 0) from ``a`` through ``peer``; stop ``a`` as soon as
    the counter ``until`` is ``at_least`` (``fetched_chunks``: the first reply's head has
    arrived; ``placed_chunks`` at a window's chunks: the first window is placed, the next ones
    on the wire and reserved), then SIGKILL it. Asserts: the fetch ends within 3 s, the
    chunks placed are a leading run that reads back byte for byte, the rest missed, ``A`` is
    suspect, nothing stays reserved.
    Returns how many chunks were placed."""
    task = asyncio.ensure_future(fetches.fetch(
        spec, [(k, frozenset({"A"})) for k in keys], {"A": peer}
    ))  # fmt: skip
    while getattr(book.counters, until) < at_least:
        assert not task.done()
        await asyncio.sleep(0)
    os.kill(a.proc.pid, signal.SIGSTOP)
    a.kill()
    start = time.monotonic()
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - start < 3.0
    held = engine.lookup(spec.ns_id, keys)
    assert held < 64 and book.counters.missed_chunks == 64 - held
    grant = engine.prepare_load(spec.ns_id, keys[:held])
    got = [b"".join(engine.read_part(grant.lease_id, k, 0)) for k in keys[:held]]
    engine.complete_load(grant.lease_id)
    assert got == [pattern(k, 0, spec.part_bytes) for k in keys[:held]]
    assert book.is_suspect("A")
    no_reservations(engine)
    await book.close()
    return held


# ----------------------------------------------------------------------------- fetching


def test_the_stream_port_is_announced_in_hello(served: DaemonProc) -> None:
    with KVClient(served.zmq_address, colocated=False, auth_token=TOKEN) as kv:
        assert kv.hello()["peer_stream_port"] == served.info["peer_stream_port"] > 0


async def test_a_fetch_over_the_stream_places_the_peers_bytes(served: DaemonProc) -> None:
    with engine_b() as engine:
        fetches, book = fetcher(engine, auth_token=TOKEN)
        holders = frozenset({"A"})
        await fetches.fetch(SPEC, [(k, holders) for k in KEYS], {"A": recorded_peer(served)})
        assert held_bytes(engine, KEYS) == expected(KEYS)
        c = book.counters
        assert (c.fetches, c.stream_fetches, c.fetched_chunks, c.placed_chunks) == (1, 1, 4, 4)
        assert book.link(recorded_peer(served)).connections_open == 0  # ZMQ never opened
        no_reservations(engine)
        await book.close()


async def test_the_stream_servers_counters_reach_metrics(served: DaemonProc) -> None:
    """``/metrics`` (parsed by prometheus_client) counts what the stream served: a fetch of
    the four chunks, then a hello with a wrong token."""
    before = scrape(served.metrics_url)
    holders = frozenset({"A"})
    for token in (TOKEN, "wrong-token-0123456789abcdef"):
        with engine_b() as engine:
            fetches, book = fetcher(engine, auth_token=token)
            await fetches.fetch(SPEC, [(k, holders) for k in KEYS], {"A": recorded_peer(served)})
            await book.close()
            assert engine.lookup(SPEC.ns_id, KEYS) == (len(KEYS) if token == TOKEN else 0)
    open_now = "kvserver_peer_stream_open_connections"
    wait_until(lambda: scrape(served.metrics_url).value(open_now) == 0)
    after = scrape(served.metrics_url)

    def delta(name: str) -> float:
        return after.value(name) - before.value(name)

    assert after.types["kvserver_peer_stream_requests"] == "counter"
    assert delta("kvserver_peer_stream_connections_total") == 2
    assert delta("kvserver_peer_stream_requests_total") == 1
    assert delta("kvserver_peer_stream_sent_chunks_total") == len(KEYS)
    assert delta("kvserver_peer_stream_sent_bytes_total") == len(KEYS) * 2 * SPEC.part_bytes
    assert delta("kvserver_peer_stream_refused_hellos_total") == 1
    assert delta("kvserver_peer_stream_errors_total") == 1  # the refusal's error reply


async def test_chunks_dram_cannot_take_are_received_into_buffers_of_their_own(
    served: DaemonProc,
) -> None:
    """A remote ``get`` through B with every page of B's DRAM pinned: the stream's parts are
    read into buffers of their own and handed back, byte for byte."""
    with make_engine(num_pages=2) as engine:
        engine.register_namespace(SPEC)
        mine = make_keys(1, tag="pinned")
        grant = engine.prepare_store(SPEC.ns_id, mine)
        assert grant is not None
        fetches, book = fetcher(engine, auth_token=TOKEN)
        direct = await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in KEYS],
                                     {"A": recorded_peer(served)}, direct=True)  # fmt: skip
        assert {k: [bytes(p) for p in row] for k, row in direct.items()} == dict(
            zip(KEYS, expected(KEYS), strict=True)
        )
        assert book.counters.stream_fetches == 1
        engine.complete_store(grant.lease_id, success=False)
        no_reservations(engine)
        await book.close()


async def test_a_fetcher_with_a_wrong_token_is_refused_and_places_nothing(
    served: DaemonProc,
) -> None:
    with engine_b() as engine:
        fetches, book = fetcher(engine, auth_token="wrong-token-0123456789", suspect_s=60)
        await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in KEYS],
                            {"A": recorded_peer(served)})  # fmt: skip
        assert engine.lookup(SPEC.ns_id, KEYS) == 0
        assert (book.counters.failures, book.counters.timeouts) == (1, 0)
        assert book.is_suspect("A")
        no_reservations(engine)
        await book.close()


@pytest.mark.parametrize("how", ["old record", "no stream port"])
async def test_a_peer_that_advertises_no_stream_is_fetched_over_zmq(
    tmp_path: Path, how: str
) -> None:
    """A fleet record written before the field (decoded as "") and a configured peer whose
    ``hello`` announces no port (``--peer-stream-port -1``, or an older daemon) are fetched
    from over ZMQ, byte for byte; the fetch asks A one ``hello`` (the port and the cap on
    unsent replies that its ZMQ windows stay under come in the same reply)."""
    extra = ("--peer-stream-port", "-1") if how == "no stream port" else ()
    a = start_daemon(tmp_path / "a", "--dram", "8MiB", *extra)
    try:
        keys = make_keys(3)
        store(a, keys)
        if how == "old record":
            record = json.loads(HostInfo("A", "i", a.zmq_address, "127.0.0.1:1").encode())
            del record["stream_address"]  # as a daemon older than the stream writes it
            decoded = HostInfo.decode(json.dumps(record))
            assert decoded.stream_address == ""
            peer = Peer("A", "i", a.zmq_address, decoded.stream_address)
        else:
            assert a.info["peer_stream_port"] == -1
            peer = Peer("A", "", a.zmq_address)  # a configured peer: asks its hello
        hellos = ("kvserver_op_duration_seconds_count", (("op", "hello"),))
        before = scrape(a.metrics_url).samples.get(hellos, 0)
        with engine_b() as engine:
            fetches, book = fetcher(engine)
            await fetches.fetch(SPEC, [(k, frozenset({"A"})) for k in keys], {"A": peer})
            assert held_bytes(engine, keys) == expected(keys)
            assert (book.counters.fetches, book.counters.stream_fetches) == (1, 0)
            assert scrape(a.metrics_url).samples.get(hellos, 0) - before == 1
            await book.close()
    finally:
        a.kill()


async def test_a_daemon_with_curve_opens_no_stream_port(tmp_path: Path) -> None:
    from kvserver.crypto import make_curve_keys

    _, secret = make_curve_keys(str(tmp_path / "keys"), "server")
    a = start_daemon(tmp_path / "a", "--dram", "8MiB", "--curve-secret-key-file", secret)
    try:
        assert a.info["peer_stream_port"] == -1
    finally:
        a.kill()


@pytest.mark.parametrize("until", ["fetched_chunks", "placed_chunks"])
async def test_a_peer_killed_mid_fetch_is_a_bounded_miss_with_nothing_reserved(
    tmp_path: Path, until: str
) -> None:
    """A holds 64 MiB; B fetches them (8 windows of 8 MiB pipelined on one stream); A is
    stopped as soon as the first reply has begun, or once the first window is placed (the
    second then being received, the third reserved ahead), then SIGKILLed: the fetch ends within
    the timeout, the windows that arrived whole are placed byte for byte (whole windows, and a
    window's leading chunks completed while its tail was on the wire),
    the rest misses, and no reservation is left.
    """
    spec = make_spec(model="test/kill", part_bytes_override=1 << 20)
    a = start_daemon(tmp_path / "a", "--dram", "80MiB")
    try:
        keys = make_keys(64, tag="kill")
        with KVClient(a.zmq_address, colocated=False) as kv:
            kv.register_namespace(spec)
            for i in range(0, 64, 8):
                chunk = keys[i : i + 8]
                data = [pattern(k, 0, spec.part_bytes) for k in chunk]
                assert kv.put(spec.ns_id, chunk, data).stored == chunk
        with make_engine(num_pages=96, page_size=1 << 20) as engine:
            engine.register_namespace(spec)
            fetches, book = fetcher(engine, 8 << 20, timeout_s=1.0, suspect_s=60)
            per_window = fetches.stream_window_bytes // spec.part_bytes
            # placed_chunks: the first window whole (its leading chunks alone, completed early
            # while its tail was on the wire, were placed_chunks > 0: A then killed before the
            # tail came left fewer than a window: seen at load 10)
            at_least = per_window if until == "placed_chunks" else 1
            held = await killed_mid_fetch(engine, fetches, book, spec, keys, a,
                                          recorded_peer(a), until, at_least)  # fmt: skip
            assert book.counters.placed_chunks == held
            # a window is placed whole, or only its leading chunks (completed early, while its
            # last EARLY_TAIL_BYTES were on the wire when A died), or not at all
            leading = per_window - max(1, fetch.EARLY_TAIL_BYTES // spec.part_bytes)
            assert held % per_window in (0, leading)
            if until == "placed_chunks":
                assert held >= per_window
    finally:
        a.kill()


# ----------------------------------------------------------------------------- a stand-in peer

Behaviour = Callable[[asyncio.StreamWriter, wire_stream.FetchRequest], Awaitable[None]]


async def serve_standin(behaviour: Behaviour) -> tuple[asyncio.Server, str]:
    """A stream server on loopback answering the first request with ``behaviour``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await reader.readexactly(wire_stream.HELLO_HEAD.size)
            await reader.readexactly(wire_stream.decode_hello_head(hello))
            head = await reader.readexactly(wire_stream.REQUEST_HEAD.size)
            body = await reader.readexactly(wire_stream.decode_request_head(head))
            await behaviour(writer, wire_stream.decode_request(body))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"tcp://127.0.0.1:{port}"


async def half_then_close(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
    writer.write(wire_stream.encode_ok(req.request_id, len(req.keys), 2, SPEC.part_bytes))
    writer.write(b"x" * (len(req.keys) * SPEC.part_bytes))  # half of the parts
    await writer.drain()


async def half_then_stall(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
    await half_then_close(writer, req)
    await asyncio.sleep(30)  # a peer that stops sending (a host gone): the timeout ends it


async def too_many(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
    writer.write(wire_stream.encode_ok(req.request_id, len(req.keys) + 1, 2, SPEC.part_bytes))
    await writer.drain()


async def wrong_size(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
    writer.write(wire_stream.encode_ok(req.request_id, 1, 2, SPEC.part_bytes * 2))
    await writer.drain()


async def garbage(writer: asyncio.StreamWriter, req: wire_stream.FetchRequest) -> None:
    writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    await writer.drain()


@pytest.mark.parametrize(
    ("behaviour", "timed_out"),
    [
        (half_then_close, True),
        (half_then_stall, True),
        (too_many, False),
        (wrong_size, False),
        (garbage, False),
    ],
)
async def test_a_reply_cut_short_or_malformed_places_nothing_and_leaves_nothing_reserved(
    behaviour: Behaviour, timed_out: bool
) -> None:
    server, address = await serve_standin(behaviour)
    async with server:
        keys = make_keys(4, tag="standin")
        with engine_b() as engine:
            fetches, book = fetcher(engine, timeout_s=0.5, suspect_s=60)
            peer = Peer("F", "", "tcp://127.0.0.1:1", address)
            start = time.monotonic()
            await fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in keys], {"F": peer})
            assert time.monotonic() - start < 2.0
            assert engine.lookup(SPEC.ns_id, keys) == 0
            c = book.counters
            assert (c.timeouts, c.failures) == ((1, 0) if timed_out else (0, 1))
            assert c.missed_chunks == 4 and book.is_suspect("F")
            no_reservations(engine)
            await book.close()


async def test_closing_the_tier_waits_for_a_fetch_under_way() -> None:
    """Shutdown closes the network tier before the arena goes: a fetch whose peer stalls
    mid-reply is waited for (it ends at the peer timeout), so no receiving thread writes into
    the arena afterwards and nothing stays reserved."""
    from kvserver.daemon.peers.tier import PeerTier

    server, address = await serve_standin(half_then_stall)
    async with server:
        keys = make_keys(4, tag="closing")
        with engine_b() as engine:
            book = PeerBook(PeerSettings(timeout_s=0.5, suspect_s=60))
            peer = Peer("F", "", "tcp://127.0.0.1:1", address)
            tier = PeerTier(engine, _OnePeer(peer), book)
            task = asyncio.ensure_future(tier.fetches.fetch(
                SPEC, [(k, frozenset({"F"})) for k in keys], {"F": peer}
            ))  # fmt: skip
            while tier.fetches.num_in_flight == 0 or book.counters.fetched_chunks == 0:
                await asyncio.sleep(0)  # until the reply's head has arrived
            assert not task.done()
            await tier.close()
            assert task.done() and tier.fetches.num_in_flight == 0
            assert engine.lookup(SPEC.ns_id, keys) == 0
            no_reservations(engine)


class _OnePeer:
    """A directory of one peer (``PeerTier`` asks it only for lookups and promotions)."""

    error = ""
    asks_peers = False

    def __init__(self, peer: Peer) -> None:
        self._peers = {peer.host_id: peer}

    def peers(self) -> Mapping[str, Peer]:
        return self._peers

    async def holders(self, ns_id: str, keys: Sequence[bytes]) -> list[frozenset[str]]:
        return [frozenset(self._peers)] * len(keys)


# ----------------------------------------------------------------------------- bad input


class Raw:
    """A raw connection to a daemon's stream port, opened with a hello carrying ``token``
    (none when ``token`` is None)."""

    def __init__(self, d: DaemonProc, token: str | None = TOKEN) -> None:
        self.sock = socket.create_connection(("127.0.0.1", d.info["peer_stream_port"]), 5)
        self.sock.settimeout(10)
        if token is not None:
            self.sock.sendall(wire_stream.encode_hello(token))

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def ask(self, ns_id: str, keys: list[bytes], request_id: int = 7) -> None:
        req = wire_stream.FetchRequest(request_id, ns_id, keys)
        self.sock.sendall(wire_stream.encode_request(req))

    def exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            assert got, "the daemon closed the connection"
            buf += got
        return buf

    def reply(self) -> tuple[wire_stream.ReplyHead, bytes]:
        head = wire_stream.decode_reply_head(self.exactly(wire_stream.REPLY_HEAD.size))
        size = head.count * head.tp * head.part_bytes if head.ok else head.count
        return head, self.exactly(size)

    def error(self) -> str:
        head, body = self.reply()
        assert not head.ok
        return wire_stream.decode_error(body).code

    def closed(self) -> bool:
        return self.sock.recv(1) == b""


def still_serving(d: DaemonProc) -> None:
    """A well-formed fetch on a new connection answers A's bytes; so does the ZMQ plane."""
    with Raw(d) as raw:
        raw.ask(SPEC.ns_id, KEYS)
        head, body = raw.reply()
        assert head.ok and (head.count, head.tp, head.part_bytes) == (4, 2, SPEC.part_bytes)
        assert body == b"".join(p for row in expected(KEYS) for p in row)
    with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN) as kv:
        assert kv.lookup(SPEC.ns_id, KEYS).hit_chunks == 4


def request_head(version: int = wire_stream.STREAM_VERSION, length: int = 10,
                 magic: bytes = wire_stream.REQUEST_MAGIC, flags: int = 0) -> bytes:  # fmt: skip
    return wire_stream.REQUEST_HEAD.pack(magic, version, flags, length)


def msgpack_request(header: Any) -> bytes:
    body = bytes(msgpack.packb(header, use_bin_type=True))
    return request_head(length=len(body)) + body


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (request_head(magic=b"GET "), "invalid_argument"),
        (request_head(version=2), "unsupported_version"),
        (request_head(flags=1), "invalid_argument"),
        (request_head(length=wire_stream.MAX_REQUEST_BYTES + 1), "invalid_argument"),
        (request_head(length=0), "invalid_argument"),
    ],
)
def test_bad_framing_is_answered_then_the_connection_closed(
    served: DaemonProc, data: bytes, code: str
) -> None:
    with Raw(served) as raw:
        raw.sock.sendall(data)
        assert raw.error() == code
        assert raw.closed()
    still_serving(served)


def hello_head(magic: bytes = wire_stream.HELLO_MAGIC, version: int = 1, length: int = 0) -> bytes:
    return wire_stream.HELLO_HEAD.pack(magic, version, length)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (wire_stream.encode_hello("not-the-token"), "unauthenticated"),
        (wire_stream.encode_hello(""), "unauthenticated"),
        (hello_head(length=2) + b"\xff\xfe", "unauthenticated"),  # not UTF-8: no token
        (wire_stream.encode_hello("x" * 255), "unauthenticated"),
        (hello_head(magic=b"GET "), "invalid_argument"),
        (hello_head(version=2), "unsupported_version"),
        (
            wire_stream.encode_request(wire_stream.FetchRequest(1, SPEC.ns_id, KEYS)),
            "invalid_argument",
        ),
    ],  # a request before any hello
)
def test_a_connection_without_the_token_is_refused_before_any_request_is_read(
    served: DaemonProc, data: bytes, code: str
) -> None:
    """The hello comes first and carries the token: a wrong or missing one, or anything that
    is not a hello, is answered (id 0) and the connection closed; no request is read."""
    with Raw(served, token=None) as raw:
        raw.sock.sendall(data)
        raw.ask(SPEC.ns_id, KEYS)  # never answered
        head, body = raw.reply()
        assert not head.ok and head.request_id == 0
        assert wire_stream.decode_error(body).code == code
        assert raw.closed()
    still_serving(served)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (request_head(length=3) + b"\xc1\xc1\xc1", "invalid_argument"),
        (msgpack_request([1, 2]), "invalid_argument"),
        (msgpack_request({"x": 1}), "invalid_argument"),
        (msgpack_request({"id": -1, "ns_id": "x", "keys": [b"k"]}), "invalid_argument"),
        (msgpack_request({"id": 1, "ns_id": "x", "keys": []}), "invalid_argument"),
        (msgpack_request({"id": 1, "ns_id": "x", "keys": [b"k" * 65]}), "invalid_argument"),
        (msgpack_request({"id": 1, "ns_id": "x", "keys": ["str"]}), "invalid_argument"),
        (msgpack_request({"id": 1, "ns_id": "0" * 16, "keys": [b"k"]}), "unknown_namespace"),
        (msgpack_request({"id": 1, "ns_id": SPEC.ns_id, "keys": [b"k"]}), "invalid_argument"),
    ],  # a key of the wrong size for the namespace
)
def test_a_bad_request_in_good_framing_is_answered_and_the_stream_goes_on(
    served: DaemonProc, data: bytes, code: str
) -> None:
    with Raw(served) as raw:
        raw.sock.sendall(data)
        assert raw.error() == code
        raw.ask(SPEC.ns_id, KEYS)  # the same connection still serves
        head, _ = raw.reply()
        assert head.ok and head.count == 4 and head.request_id == 7
    still_serving(served)


def test_a_tenant_gets_only_the_namespaces_its_token_grants(served: DaemonProc) -> None:
    """A namespace the token does not grant is answered as one registered nowhere."""
    nowhere = make_spec(model="other", block_size=8).ns_id
    for ns_id in (SPEC.ns_id, nowhere):
        with Raw(served, token=TENANT) as raw:
            raw.ask(ns_id, KEYS)
            assert raw.error() == "unknown_namespace"
    still_serving(served)


def test_the_leading_run_held_is_sent_and_pipelined_requests_answer_in_order(
    served: DaemonProc,
) -> None:
    with Raw(served) as raw:
        raw.ask(SPEC.ns_id, [*KEYS[:2], make_keys(1, tag="absent")[0], KEYS[3]], request_id=1)
        raw.ask(SPEC.ns_id, make_keys(2, tag="absent"), request_id=2)
        raw.ask(SPEC.ns_id, KEYS[2:], request_id=3)
        counts = []
        for want in (1, 2, 3):
            head, body = raw.reply()
            assert head.ok and head.request_id == want
            counts.append(head.count)
        assert counts == [2, 0, 2]
        assert body == b"".join(p for row in expected(KEYS[2:]) for p in row)


def test_a_truncated_hello_or_request_then_a_close_leaves_the_daemon_serving(
    served: DaemonProc,
) -> None:
    hello = wire_stream.encode_hello(TOKEN)
    body = msgpack.packb({"id": 1, "ns_id": SPEC.ns_id, "keys": KEYS})
    data = hello + request_head(length=len(body)) + body
    for cut in (1, wire_stream.HELLO_HEAD.size, len(hello) - 1, len(hello) + 3,
                len(hello) + wire_stream.REQUEST_HEAD.size + 5):  # fmt: skip
        with Raw(served, token=None) as raw:
            raw.sock.sendall(data[:cut])
    still_serving(served)


HELLO = wire_stream.encode_hello(TOKEN)


@given(data=st.one_of(
    st.binary(max_size=300),  # no hello
    st.builds(lambda n, tail: hello_head(length=n) + tail, st.integers(0, 255),
              st.binary(max_size=300)),
    st.builds(lambda tail: HELLO + tail, st.binary(max_size=256)),
    st.builds(lambda tail: HELLO + request_head(length=len(tail)) + tail, st.binary(max_size=256)),
    st.builds(lambda n, tail: HELLO + request_head(length=n) + tail,
              st.integers(0, (1 << 32) - 1), st.binary(max_size=64)),
    st.builds(lambda d: HELLO + msgpack_request(d), st.dictionaries(
        st.sampled_from(["id", "ns_id", "keys", "x"]),
        st.one_of(st.integers(-5, (1 << 64) - 1), st.text(max_size=8), st.binary(max_size=70),
                  st.lists(st.binary(max_size=70), max_size=3), st.none()),
    )),
))  # fmt: skip
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
def test_fuzzed_input_gets_errors_or_a_close_and_the_daemon_keeps_serving(
    served: DaemonProc, data: bytes
) -> None:
    """Whatever arrives (with or without a hello): every reply is a well-formed error reply
    (never a crash, never bytes), then either the stream goes on or the daemon closes it; the
    daemon serves everyone else."""
    with Raw(served, token=None) as raw:
        raw.sock.sendall(data)
        raw.sock.shutdown(socket.SHUT_WR)  # nothing more comes: what is cut short is so
        rest = b""
        while chunk := raw.sock.recv(1 << 16):
            rest += chunk
        while rest:  # only error replies
            head = wire_stream.decode_reply_head(rest[: wire_stream.REPLY_HEAD.size])
            assert not head.ok
            end = wire_stream.REPLY_HEAD.size + head.count
            assert wire_stream.decode_error(rest[wire_stream.REPLY_HEAD.size : end]).code in {
                "invalid_argument", "unsupported_version", "unauthenticated",
                "unknown_namespace", "permission_denied",
            }  # fmt: skip
            rest = rest[end:]
    still_serving(served)


def test_connections_past_the_bound_are_closed_at_once(served: DaemonProc) -> None:
    """At most MAX_CONNECTIONS connections are served; one more is closed without a byte
    read, and once some close, new ones are served again."""
    from kvserver.daemon.stream_server import MAX_CONNECTIONS

    held = [Raw(served) for _ in range(MAX_CONNECTIONS)]
    try:
        held[-1].ask(SPEC.ns_id, KEYS[:1])  # every one of them accepted and served by now
        assert held[-1].reply()[0].ok
        with Raw(served) as extra, contextlib.suppress(ConnectionResetError):  # hello unread
            assert extra.closed()
    finally:
        for raw in held:
            raw.sock.close()

    def serves() -> bool:  # the daemon notices the closed connections on its own schedule
        try:
            still_serving(served)
        except (AssertionError, OSError):
            return False
        return True

    wait_until(serves)


def test_timed_out_reads_close_a_silent_connection(tmp_path: Path) -> None:
    """A connection that sends part of a request and then nothing is closed after the
    daemon's peer timeout; the daemon serves meanwhile."""
    a = start_daemon(tmp_path / "a", "--dram", "8MiB", "--peer-timeout-s", "0.5")
    try:
        with socket.create_connection(("127.0.0.1", a.info["peer_stream_port"]), 5) as sock:
            sock.settimeout(10)
            sock.sendall(request_head(length=100)[:4])
            start = time.monotonic()
            assert sock.recv(1) == b""  # closed by the daemon, not by us
            assert time.monotonic() - start < 5
    finally:
        a.kill()


def test_stream_framing_round_trips() -> None:
    hello = wire_stream.encode_hello("tök")
    n = wire_stream.decode_hello_head(hello[: wire_stream.HELLO_HEAD.size])
    assert wire_stream.decode_token(hello[wire_stream.HELLO_HEAD.size :]) == "tök"
    assert n == len("tök".encode())
    with pytest.raises(InvalidArgument):
        wire_stream.encode_hello("x" * 256)
    req = wire_stream.FetchRequest(5, "abcd", [b"k1", b"k2"])
    data = wire_stream.encode_request(req)
    n = wire_stream.decode_request_head(data[: wire_stream.REQUEST_HEAD.size])
    assert wire_stream.decode_request(data[wire_stream.REQUEST_HEAD.size :]) == req
    assert n == len(data) - wire_stream.REQUEST_HEAD.size
    head = wire_stream.decode_reply_head(wire_stream.encode_ok(5, 2, 4, 4096))
    assert head == wire_stream.ReplyHead(True, 4, 5, 2, 4096)
    err = wire_stream.encode_error(9, InvalidArgument("nope"))
    head = wire_stream.decode_reply_head(err[: wire_stream.REPLY_HEAD.size])
    assert not head.ok and head.request_id == 9
    error = wire_stream.decode_error(err[wire_stream.REPLY_HEAD.size :])
    assert error.code == "invalid_argument" and "nope" in str(error)
    assert struct.calcsize(">4sBBI") == wire_stream.REQUEST_HEAD.size


def test_silent_connections_from_one_address_cannot_take_every_slot(tmp_path: Path) -> None:
    """Connections that send no hello held their slot for the hello timeout each: one address
    opening 256 of them (no token needed) kept every other peer's new connection out. Now at
    most MAX_HELLO_WAITS_PER_ADDRESS wait from one address: one more from it is closed at once
    (not after the 30 s timeout), and a peer from another address (127.0.0.2) is served."""
    from kvserver.daemon.stream_server import MAX_HELLO_WAITS_PER_ADDRESS

    d = start_daemon(tmp_path / "a", "--dram", "8MiB", "--auth-token", TOKEN,
                     "--peer-timeout-s", "30")  # fmt: skip
    port = d.info["peer_stream_port"]
    silent: list[socket.socket] = []
    try:
        with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN) as kv:
            kv.register_namespace(SPEC)
            parts = [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in KEYS]
            assert kv.put(SPEC.ns_id, KEYS, parts).stored == KEYS
        silent = [socket.create_connection(("127.0.0.1", port), 5)
                  for _ in range(MAX_HELLO_WAITS_PER_ADDRESS)]  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), 5) as extra:
            extra.settimeout(10)
            started = time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                assert extra.recv(1) == b""
            assert time.monotonic() - started < 5
        other = socket.create_connection(("127.0.0.1", port), 5, source_address=("127.0.0.2", 0))
        with other:
            other.settimeout(10)
            other.sendall(wire_stream.encode_hello(TOKEN))
            other.sendall(wire_stream.encode_request(wire_stream.FetchRequest(3, SPEC.ns_id, KEYS)))
            head = wire_stream.decode_reply_head(other.recv(wire_stream.REPLY_HEAD.size,
                                                            socket.MSG_WAITALL))  # fmt: skip
            assert head.ok and head.count == 4
    finally:
        for sock in silent:
            sock.close()
        d.kill()
