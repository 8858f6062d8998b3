"""A ``get`` reply carrying more than its request may bring back is refused before it is kept
or copied, by a fetching daemon's peer link and by a client: more payload frames than the
keys' parts may take (``kvserver/client/replies.py``: received one at a time and dropped, not
made into ``zmq.Frame`` objects), or a part whose frames (``part_frames``) add up to another
size than the namespace's (refused before it is joined into a second buffer of that size).
The bytes themselves are in memory once while they arrive: libzmq holds a multipart message
whole before its first frame can be read, so no receiver can bound that. The server is a
stand-in process (``tests/support/split_part_peer.py``); what the receiver allocates is
measured with tracemalloc (Python's heap: the joined ``bytes``, the ``zmq.Frame`` objects;
not libzmq's buffers).
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from collections.abc import Iterator

import pytest

from kvserver.client import KVClient
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.directory import Peer
from kvserver.daemon.peers.fetch import PeerFetches
from kvserver.errors import InvalidArgument, KVServerError
from tests.kvserver.builders import make_engine, make_keys, make_spec
from tests.kvserver.daemon.peers.test_stream import no_reservations

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/reply-parts")  # one part of 4 KiB per chunk
FRAMES, FRAME_BYTES = 2, 16 << 20  # one "part" of 32 MiB, in as few frames as a part may take
#: what the fetch may allocate (Python's heap) while the reply is refused: far under its
#: 32 MiB (before: the joined part, +32 MiB).
BOUND = 8 << 20
EMPTY_FRAMES = 200_000


def stand_in(*args: object) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.split_part_peer", *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def fake_peer() -> Iterator[str]:
    yield from stand_in(FRAMES, FRAME_BYTES, "part")


@pytest.fixture
def flooding_peer() -> Iterator[str]:
    """Its get reply: 200,000 empty frames (~400 KB on the wire)."""
    yield from stand_in(EMPTY_FRAMES, 0, "extra")


async def fetch_refused(address: str, tag: str) -> int:
    """Fetch 4 keys from the stand-in at ``address`` into a fresh engine and check that its
    reply was refused: the fetch allocated under BOUND, placed nothing and left nothing
    reserved, and the peer is suspect with the 4 keys missed. Returns how many connections
    the peer's link kept open."""
    keys = make_keys(4, tag=tag)
    engine = make_engine(num_pages=64)
    engine.register_namespace(SPEC)
    with engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=10, suspect_s=60))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        peer = Peer("F", "", address)
        tracemalloc.start()
        try:
            await fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in keys], {"F": peer})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < BOUND, f"the fetch allocated {peak >> 20} MiB"
        assert engine.lookup(SPEC.ns_id, keys) == 0  # nothing placed
        assert book.is_suspect("F") and book.counters.missed_chunks == 4
        no_reservations(engine)
        open_connections = book.link(peer).connections_open
        await book.close()
        return open_connections


def get_refused(address: str, tag: str, match: str) -> KVServerError:
    """A KVClient that registered the namespace gets 2 keys from the stand-in at ``address``:
    the reply is refused with InvalidArgument (``match``), the client allocated under BOUND
    meanwhile, and it goes on (its next call is answered). Returns the error."""
    keys = make_keys(2, tag=tag)
    with KVClient(address, colocated=False, timeout=10) as kv:
        kv.register_namespace(SPEC)
        tracemalloc.start()
        try:
            with pytest.raises(InvalidArgument, match=match) as info:
                kv.get(SPEC.ns_id, keys)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < BOUND, f"the client allocated {peak >> 20} MiB"
        assert kv.hello()["sid"] == "split-part-peer"
    return info.value


async def test_a_fetch_refuses_a_split_part_larger_than_the_namespaces(fake_peer: str) -> None:
    await fetch_refused(fake_peer, "split")


def test_a_client_refuses_a_split_part_of_another_size(fake_peer: str) -> None:
    """The same reply to a KVClient: InvalidArgument, without the joined copy (before:
    +32 MiB)."""
    get_refused(fake_peer, "client", "reply part of the wrong size")


async def test_a_fetch_refuses_a_reply_with_more_frames_than_its_get_may_bring(
    flooding_peer: str,
) -> None:
    """200,000 empty frames answer a get of 4 keys of one 4 KiB part each (at most 8 frames):
    received one at a time and dropped, not made into 200,000 zmq.Frame objects (before:
    +45 MiB of Python's heap, tracemalloc); the peer suspect, nothing placed, the connection
    not reused."""
    assert await fetch_refused(flooding_peer, "flood") == 0


def test_a_client_refuses_a_reply_with_more_frames_than_its_get_may_bring(
    flooding_peer: str,
) -> None:
    """The same reply to a KVClient: InvalidArgument naming the frames, without keeping them;
    the connection is replaced and the next call answered."""
    error = get_refused(flooding_peer, "client-flood", "more frames than its request")
    assert error.context["frames"] == EMPTY_FRAMES and error.context["max"] == 4


@pytest.fixture
def short_peer() -> Iterator[str]:
    """Its get reply: 3 parts of 16 bytes (2 keys of one rank asked: 2 parts)."""
    yield from stand_in(3, 16, "extra")


def test_a_client_refuses_a_reply_of_another_number_of_parts_than_asked(
    short_peer: str,
) -> None:
    """3 parts answer a get of 2 keys of one part each (within the frames the get may bring
    back): InvalidArgument (before: rows of one part each, the third dropped without a word;
    a reply of one part for 2 keys gave rows of none)."""
    error = get_refused(short_peer, "client-short", "another number of parts than asked")
    assert error.context == {"parts": 3, "keys": 2, "per_key": 1}
