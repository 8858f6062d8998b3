"""A peer's ``get`` reply whose ``part_frames`` names many frames as one part (a part far
larger than the namespace's) is refused before the part is joined: the fetching daemon does
not copy the reply's bytes into a second buffer of their whole size (they are in its memory
once already, as ZMQ's frames: libzmq holds a multipart message whole before its first frame
can be read, so no receiver can bound that copy). The peer is a stand-in process
(``tests/support/split_part_peer.py``); the copy is measured with tracemalloc (Python's
allocations: the joined ``bytes``; ZMQ's frames are not counted).
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
from kvserver.errors import InvalidArgument
from tests.kvserver.builders import make_engine, make_keys, make_spec
from tests.kvserver.daemon.peers.test_stream import no_reservations

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/reply-parts")  # one part of 4 KiB per chunk
FRAMES, FRAME_BYTES = 512, 64 << 10  # one "part" of 32 MiB
#: what the fetch may allocate (Python's heap) while the reply is refused: far under its
#: 32 MiB (before: the joined part, +32 MiB).
BOUND = 8 << 20


@pytest.fixture
def fake_peer() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.split_part_peer", str(FRAMES), str(FRAME_BYTES)],
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


async def test_a_fetch_refuses_a_split_part_larger_than_the_namespaces(fake_peer: str) -> None:
    keys = make_keys(4, tag="split")
    engine = make_engine(num_pages=64)
    engine.register_namespace(SPEC)
    with engine:
        book = PeerBook(PeerSettings(stream=False, timeout_s=10, suspect_s=60))
        fetches = PeerFetches(engine, book, publish=lambda: None)
        tracemalloc.start()
        try:
            await fetches.fetch(SPEC, [(k, frozenset({"F"})) for k in keys],
                                {"F": Peer("F", "", fake_peer)})  # fmt: skip
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < BOUND, f"the fetch allocated {peak >> 20} MiB"
        assert engine.lookup(SPEC.ns_id, keys) == 0  # nothing placed
        assert book.is_suspect("F") and book.counters.missed_chunks == 4
        no_reservations(engine)
        await book.close()


def test_a_client_refuses_a_split_part_of_another_size(fake_peer: str) -> None:
    """The same reply to a KVClient that registered the namespace: InvalidArgument, without
    the joined copy (before: +32 MiB); the client goes on (its next call is answered)."""
    keys = make_keys(2, tag="client")
    with KVClient(fake_peer, colocated=False, timeout=10) as kv:
        kv.register_namespace(SPEC)
        tracemalloc.start()
        try:
            with pytest.raises(InvalidArgument, match="reply part of the wrong size"):
                kv.get(SPEC.ns_id, keys)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < BOUND, f"the client allocated {peak >> 20} MiB"
        assert kv.hello()["sid"] == "split-part-peer"
