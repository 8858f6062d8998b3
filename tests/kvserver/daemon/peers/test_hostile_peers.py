"""A peer that is not a kvserver, or another version, as the fetching daemon meets it: over
ZMQ and over the peer stream, stand-in servers (real sockets on loopback) answer whatever a
test draws. Whatever they send, the fetch ends within its peer timeouts, what the fetching
daemon places is exactly the bytes the peer sent for those keys (a reply of the right shape),
nothing of a refused reply is placed, and no page stays reserved. ``test_stream.py`` and
``test_reply_parts.py`` have the named faults; here the spaces of replies are drawn
(hypothesis)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver import wire, wire_stream
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.daemon.peers.static import StaticDirectory
from kvserver.engine import StorageEngine
from kvserver.wire_requests import unpack_header
from tests.kvserver.builders import make_keys, pattern
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, held_bytes
from tests.kvserver.daemon.peers.test_stream import no_reservations

pytestmark = pytest.mark.multiprocess

SID = "stand-in"
KEYS = make_keys(3, tag="hostile")
TP, PART = SPEC.tp_world_size, SPEC.part_bytes
#: the peer timeout of a fetch whose peer answers (in milliseconds on loopback: patient, for a
#: loaded machine), and of one whose peer leaves it waiting (a drawn silence: short)
TIMEOUT_S, WAITED_S = 5.0, 0.5


def bound(timeout_s: float) -> float:
    """The most a fetch may take: a hello and a get, each within the timeout, and room."""
    return 2 * timeout_s + 3.0


Answer = Callable[[dict[str, Any]], list[bytes] | None]


@contextlib.asynccontextmanager
async def zmq_standin(answer: Answer) -> AsyncIterator[str]:
    """A ROUTER on loopback answering each request with ``answer(header)``'s frames (None:
    no reply); its address."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            peer, header, *_ = await sock.recv_multipart()
            frames = answer(unpack_header(header))
            if frames is not None:
                await sock.send_multipart([peer, *frames])

    task = asyncio.ensure_future(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        ctx.term()


def hello(req: dict[str, Any]) -> list[bytes]:
    return [wire.encode_reply(req["id"], SID, {"sid": SID, "protocol_version": 1})]


def correct_frames(n: int) -> list[bytes]:
    return [pattern(k, r, PART) for k in KEYS[:n] for r in range(TP)]


def held(engine: StorageEngine) -> list[bytes]:
    """The leading keys of KEYS the engine holds, checked byte for byte against what the
    stand-in sends for them (AssertionError if any byte differs)."""
    n = engine.lookup(SPEC.ns_id, KEYS)
    if n:
        assert held_bytes(engine, KEYS[:n]) == [
            [pattern(k, r, PART) for r in range(TP)] for k in KEYS[:n]
        ]
    return KEYS[:n]


async def fetch_from(
    address: str, stream: str = "", timeout_s: float = TIMEOUT_S
) -> tuple[list[bytes], PeerBook, float]:
    """Fetch KEYS from the stand-in at ``address`` (its stream at ``stream``; "": ZMQ) into a
    fresh engine: the keys placed (checked byte for byte), the book, the time taken."""
    with engine_b() as engine:
        book = PeerBook(PeerSettings(timeout_s=timeout_s, suspect_s=60))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("F", "i", address, stream)
        start = time.monotonic()
        try:
            await fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in KEYS], {"F": peer})
            took = time.monotonic() - start
            placed = held(engine)
            no_reservations(engine)
        finally:
            await book.close()
    return placed, book, took


# ------------------------------------------------------------------------ not a kvserver


async def test_a_peer_whose_hello_is_not_a_kvservers_is_a_failure_not_an_error() -> None:
    """The stand-in answers ``hello`` with a reply no kvserver sends (no ``sid``: another
    program, another version): the fetch misses, the peer is a failure and suspect. Before:
    the client's KeyError came out of the fetch, failing the client's load (an internal
    error) instead of a miss."""

    def answer(req: dict[str, Any]) -> list[bytes]:
        return [wire.encode_reply(req["id"], SID, {"version": "9.9"})]

    async with zmq_standin(answer) as address:
        placed, book, took = await fetch_from(address)
    assert placed == [] and took < bound(TIMEOUT_S)
    assert book.counters.failures == 1 and book.is_suspect("F")


async def test_a_lookup_answer_that_is_not_a_kvservers_makes_that_peer_suspect() -> None:
    """With ``--peers``, a lookup asks each peer; one answers a ``lookup`` without its fields:
    it holds nothing and is suspect, and the directory answers. Before: KeyError out of
    the lookup (the client's ``Lookup`` failed)."""

    def answer(req: dict[str, Any]) -> list[bytes]:
        if req["op"] == wire.HELLO:
            return hello(req)
        return [wire.encode_reply(req["id"], SID, {"hits": 3})]

    async with zmq_standin(answer) as address:
        book = PeerBook(PeerSettings(timeout_s=TIMEOUT_S, suspect_s=60))
        directory = StaticDirectory([address], book)
        try:
            assert await directory.holders(SPEC.ns_id, KEYS) == []
            assert book.counters.failures == 1 and book.is_suspect(address)
        finally:
            await book.close()


# ------------------------------------------------------------------------ ZMQ replies drawn


@dataclass(frozen=True)
class ZmqReply:
    """A drawn answer to the fetch's ``get``: for the leading run ``n``, with ``fault`` ("": as
    a kvserver sends it). The header: ``raw`` as drawn, else an error with ``code``, else an
    ok reply of ``result`` to the request's id plus ``shift``; then ``frames``; ``silent``:
    no answer at all."""

    n: int
    fault: str
    frames: tuple[bytes, ...] = ()
    result: Any = None
    shift: int = 0
    raw: bytes | None = None
    code: str = ""
    silent: bool = False

    @property
    def waits(self) -> bool:
        """Whether the fetch is left waiting for a reply (none, or none it can take)."""
        return self.fault in ("header", "silent", "other_id")

    def answer(self, req: dict[str, Any]) -> list[bytes] | None:
        if req["op"] == wire.HELLO:
            return hello(req)
        if self.silent:
            return None
        if self.raw is not None:
            header = self.raw
        elif self.code:
            header = wire.encode_error(req["id"], SID, self.code, "drawn")
        else:
            header = wire.encode_reply(req["id"] + self.shift, SID, self.result)
        return [header, *self.frames]


SIZES = st.sampled_from([0, 1, PART - 1, PART + 1, 2 * PART])
CODES = st.sampled_from(["unknown_namespace", "capacity", "internal", "invalid_argument", "??"])


@st.composite
def zmq_replies(draw: st.DrawFn) -> ZmqReply:
    n = draw(st.integers(0, len(KEYS)))
    frames = correct_frames(n)
    result: dict[str, Any] = {"keys": KEYS[:n]}
    fault = draw(st.sampled_from(
        ["", "keys", "frame_size", "drop_frame", "extra_frame", "part_frames", "header",
         "error", "silent", "other_id"]
    ))  # fmt: skip
    if fault == "header":
        return ZmqReply(n, fault, tuple(frames), raw=draw(st.binary(max_size=64)))
    if fault == "error":
        return ZmqReply(n, fault, code=draw(CODES))
    if fault == "silent":
        return ZmqReply(n, fault, silent=True)
    if fault == "other_id":
        return ZmqReply(n, fault, tuple(frames), result, shift=draw(st.integers(1, 3)))
    if fault == "keys":
        result["keys"] = draw(st.one_of(
            st.just(KEYS[::-1]), st.just([*KEYS, b"x" * 32]),
            # what msgpack packs (was st.integers(): a drawn one past 2**64 failed the
            # stand-in's own packing, OverflowError, not the code under test)
            st.integers(-(2**63), 2**64 - 1), st.lists(st.binary(max_size=40), max_size=4),
        ))  # fmt: skip
    elif fault == "part_frames":
        result["part_frames"] = draw(st.one_of(
            st.lists(st.integers(-1, 7), max_size=8), st.text(max_size=3), st.none()
        ))  # fmt: skip
    elif fault == "frame_size" and frames:
        frames[draw(st.integers(0, len(frames) - 1))] = b"x" * draw(SIZES)
    elif fault == "drop_frame" and frames:
        del frames[draw(st.integers(0, len(frames) - 1))]
    elif fault:  # an extra frame (or, with none to change or drop, one more)
        frames.insert(draw(st.integers(0, len(frames))), b"x" * draw(SIZES))
    return ZmqReply(n, fault, tuple(frames), result)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=zmq_replies())
def test_whatever_a_zmq_peer_answers_nothing_wrong_is_placed_and_nothing_hangs(
    reply: ZmqReply,
) -> None:
    """A reply as a kvserver sends it places its leading run, byte for byte, and the peer is
    not suspect; any other (wrong keys, parts of the wrong number or size, ``part_frames``
    that do not add up, an unreadable header, an error, another request's reply, none) places
    nothing it did not send whole and right, ends within the peer timeouts, and leaves no
    page reserved."""

    async def run() -> tuple[list[bytes], PeerBook, float]:
        async with zmq_standin(reply.answer) as address:
            return await fetch_from(address, timeout_s=timeout_s)

    timeout_s = WAITED_S if reply.waits else TIMEOUT_S
    placed, book, took = asyncio.run(run())
    assert took < bound(timeout_s)
    if reply.fault == "":
        assert placed == KEYS[: reply.n]
        assert (book.counters.failures, book.counters.timeouts) == (0, 0)
    elif reply.fault in ("header", "silent", "other_id"):
        assert placed == [] and book.counters.timeouts == 1


# --------------------------------------------------------------------- stream replies drawn


@dataclass(frozen=True)
class StreamReply:
    """A drawn answer on the stream to the fetch's one request: ``data`` with ``@ID@`` for the
    request's id (4 bytes), then the connection closed (``close``) or held open."""

    n: int
    fault: str
    data: bytes
    close: bool

    @property
    def waits(self) -> bool:
        """Whether the fetch is left waiting for bytes that never come (the connection held
        open): silence, a reply cut short, or fewer bytes than a head."""
        short = self.fault == "short" or (self.fault == "garbage" and len(self.data) < 24)
        return self.fault == "silent" or (short and not self.close)


def head(n: int, **fields: int) -> bytes:
    """A reply head for the leading run of ``n`` (with ``@ID@`` for the id), ``fields``
    changed (magic, version, status, tp, count, size)."""
    values = {"magic": int.from_bytes(wire_stream.REPLY_MAGIC, "big"), "version": 1,
              "status": 0, "tp": TP, "count": n, "size": PART} | fields  # fmt: skip
    front = struct.pack(">IBBH", values["magic"], values["version"], values["status"], values["tp"])
    return front + b"@ID@" + struct.pack(">IQ", values["count"], values["size"])


@st.composite
def stream_replies(draw: st.DrawFn) -> StreamReply:
    n = draw(st.integers(0, len(KEYS)))
    payload = b"".join(correct_frames(n))
    fault = draw(st.sampled_from(
        ["", "field", "short", "long", "error", "garbage", "silent", "other_id"]
    ))  # fmt: skip
    if fault == "field":
        name = draw(st.sampled_from(["magic", "version", "status", "tp", "count", "size"]))
        value = draw({
            "magic": st.integers(0, 2**32 - 1).filter(
                lambda v: v != int.from_bytes(wire_stream.REPLY_MAGIC, "big")),
            "version": st.integers(2, 255),
            "status": st.integers(2, 255),
            "tp": st.integers(0, 65535).filter(lambda v: v != TP),
            "count": st.integers(len(KEYS) + 1, 2**32 - 1),
            "size": st.integers(0, 2**64 - 1).filter(lambda v: v != PART),
        }[name])  # fmt: skip
        return StreamReply(n, fault, head(n, **{name: value}) + payload, draw(st.booleans()))
    if fault == "short":
        cut = draw(st.integers(0, max(0, len(payload) - 1))) if payload else 0
        data = head(n) + payload[:cut] if payload else head(n)[: draw(st.integers(0, 23))]
        return StreamReply(n, fault, data, draw(st.booleans()))
    if fault == "long":
        return StreamReply(n, fault, head(n) + payload + draw(st.binary(min_size=1)), False)
    if fault == "error":
        count = draw(st.integers(0, 2048))
        body = draw(st.binary(max_size=count))
        return StreamReply(n, fault, head(0, status=1, tp=0, count=count, size=0) + body, True)
    if fault == "garbage":
        return StreamReply(n, fault, draw(st.binary(max_size=64)), draw(st.booleans()))
    if fault == "silent":
        return StreamReply(n, fault, b"", False)
    if fault == "other_id":
        return StreamReply(n, fault, head(n).replace(b"@ID@", b"\0\0\0\x63") + payload, False)
    return StreamReply(n, fault, head(n) + payload, False)


@contextlib.asynccontextmanager
async def stream_standin(reply: StreamReply) -> AsyncIterator[str]:
    """A stream server on loopback: reads the hello and one request, answers ``reply``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello_head = await reader.readexactly(wire_stream.HELLO_HEAD.size)
            await reader.readexactly(wire_stream.decode_hello_head(hello_head))
            request_head = await reader.readexactly(wire_stream.REQUEST_HEAD.size)
            body = await reader.readexactly(wire_stream.decode_request_head(request_head))
            req_id = wire_stream.decode_request(body).request_id
            writer.write(reply.data.replace(b"@ID@", struct.pack(">I", req_id)))
            await writer.drain()
            if not reply.close:
                await reader.read()  # held open until the fetcher closes it
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=stream_replies())
def test_whatever_a_stream_peer_answers_nothing_wrong_is_placed_and_nothing_hangs(
    reply: StreamReply,
) -> None:
    """Over the peer stream: a reply as a kvserver sends it (trailing bytes or not) places its
    leading run byte for byte; a head with any field wrong, a reply cut short, an error with
    any body, bytes that are no reply, another request's reply or none place nothing, end
    within the peer timeout and leave no page reserved."""

    async def run() -> tuple[list[bytes], PeerBook, float]:
        async with stream_standin(reply) as stream:
            return await fetch_from("tcp://127.0.0.1:1", stream, timeout_s)

    timeout_s = WAITED_S if reply.waits else TIMEOUT_S
    placed, book, took = asyncio.run(run())
    assert took < bound(timeout_s)
    if reply.fault in ("", "long"):
        assert placed == KEYS[: reply.n]
        assert (book.counters.failures, book.counters.timeouts) == (0, 0)
    else:
        assert placed == []
