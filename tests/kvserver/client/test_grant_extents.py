"""A co-located client copies only inside the arena it mapped, whatever a grant's extents say
(``kvserver/client/parts.py`` ``check_extents``): a grant is the daemon's word, and a
memoryview slice past the arena's end is silently shorter, a negative offset counts from its
end (another key's pages), and a load sized its buffers from the extents before copying.

The copies are tested on a mapped file (no daemon can be made to send such extents); the
load against a real daemon, its grant altered on the way in (the fault injected), measured
with tracemalloc.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver import grants
from kvserver.arena import ArenaView
from kvserver.client import KVClient
from kvserver.client.parts import check_grant_extents, readinto_part, write_part
from kvserver.errors import InvalidArgument
from kvserver.grants import LoadGrant
from tests.kvserver.builders import make_keys
from tests.kvserver.client.test_client import SPEC, as_bytes, parts
from tests.support.daemon import DaemonProc, start_daemon, wait_until

PAGE = 4096
SIZE = 16 * PAGE


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[ArenaView]:
    path = tmp_path / "arena"
    path.write_bytes(bytes(SIZE))
    with ArenaView.attach(str(path)) as view:
        yield view


BAD = [
    pytest.param(((-PAGE, PAGE),), id="negative-offset"),
    pytest.param(((SIZE - PAGE, 2 * PAGE),), id="past-the-end"),
    pytest.param(((0, PAGE), (SIZE, PAGE)), id="second-extent-past-the-end"),
    pytest.param(((0, -PAGE),), id="negative-length"),
    pytest.param(((0.0, PAGE),), id="not-an-integer"),
]


@pytest.mark.parametrize("extents", BAD)
def test_a_part_outside_the_arena_is_neither_written_nor_read(
    arena: ArenaView, extents: Any
) -> None:
    """InvalidArgument naming the arena's size, nothing written (before: a negative offset
    wrote the arena's last page, a second extent past the end was refused with a bare
    ValueError after the first was written)."""
    length = sum(n for _, n in extents)
    data = b"\xab" * max(length, 0)
    with pytest.raises(InvalidArgument, match="outside the mapped arena") as info:
        write_part(arena, extents, data)
    assert info.value.context["arena_bytes"] == SIZE
    assert bytes(arena.buf) == bytes(SIZE)  # nothing written
    with pytest.raises(InvalidArgument, match="outside the mapped arena"):
        readinto_part(arena, extents, bytearray(max(length, 0)))


def test_a_grant_naming_more_bytes_than_the_arena_holds_is_refused(arena: ArenaView) -> None:
    """Every extent inside, but a part (or the grant's parts together) larger than the arena:
    its pages cannot all be distinct, refused before a buffer is sized from them."""
    whole = ((0, SIZE),)
    check_grant_extents(arena, [[whole]])
    with pytest.raises(InvalidArgument, match="part larger than the mapped arena"):
        check_grant_extents(arena, [[whole + whole]])
    with pytest.raises(InvalidArgument, match="parts larger than the mapped arena"):
        check_grant_extents(arena, [[whole], [whole]])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("grants"), "--page-size", "4KiB", "--dram", "16MiB")
    yield d
    assert d.terminate() == 0, d.log()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "lie",
    [
        pytest.param([[((0, 1 << 40),)] * 2] * 2, id="terabytes"),
        pytest.param([[((0, 16 << 20),)] * 2] * 2, id="each-part-the-whole-arena"),
        pytest.param([[((0, PAGE),)] * 2] * 3, id="more-keys-than-asked"),
    ],
)
def test_a_load_refuses_a_grant_outside_the_arena_and_releases_it(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch, lie: list[list[Any]]
) -> None:
    """A co-located ``load`` whose grant (altered on its way in) names extents past the
    arena, parts adding up to more than it holds, or more keys than asked: InvalidArgument
    with nothing large allocated (before: a bytearray of each part's announced size, 1 TiB:
    MemoryError; 16 MiB a part: 64 MiB), its pins released (``complete_load`` sent), and the
    client's next load answered right."""
    keys = make_keys(2, tag=f"grant-{len(lie)}-{lie[0][0][0][1]}")
    real = grants.packed_load_grant_from_wire
    with KVClient(daemon.zmq_address, colocated=True) as kv:
        kv.register_namespace(SPEC)
        assert kv.store(SPEC.ns_id, keys, parts(keys)) == keys

        def lying(*args: Any, **kwargs: Any) -> LoadGrant:
            g = real(*args, **kwargs)
            return LoadGrant(g.lease_id, g.deadline, g.ns_id, g.keys, lie, g.granted_by)

        monkeypatch.setattr(grants, "packed_load_grant_from_wire", lying)
        tracemalloc.start()
        try:
            with pytest.raises(InvalidArgument, match=r"arena|keys than asked"):
                kv.load(SPEC.ns_id, keys)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"the client allocated {peak >> 20} MiB"
        monkeypatch.undo()
        wait_until(lambda: kv.stats()["pinned_pages"] == 0)
        assert as_bytes(kv.load(SPEC.ns_id, keys)) == parts(keys)
        assert kv.is_colocated
