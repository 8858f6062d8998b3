"""A request asked again reuses its last lookup (``lookup_reuse_s``, scheduler/
kv_connector_loads.py) until the bound passes or the connector sees one of the chunks its
answer rests on change; against a real daemon, with the fake TP workers of
``test_kv_connector`` and a clock the test moves."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.wire import LOOKUP
from tests.scheduler.test_kv_connector import FakeRequest, Harness, make_spec, tokens
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

REUSE_S = 1.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "64KiB")  # 16 pages
    yield d
    assert d.terminate() == 0, d.log()


@pytest.fixture
def now() -> list[float]:
    return [100.0]


@pytest.fixture
def harness(daemon: DaemonProc, now: list[float]) -> Iterator[Harness]:
    h = Harness(daemon, make_spec(model="test/reuse"), clock=lambda: now[0],
                lookup_reuse_s=REUSE_S)  # fmt: skip
    yield h
    h.close()


def daemon_lookups(h: Harness) -> int:
    return h.conn.client.sent_by_op[LOOKUP]


def test_asked_again_within_the_bound_the_last_answer_is_reused(
    harness: Harness, now: list[float]
) -> None:
    """A request asked at every step while it waits for blocks: one daemon lookup until
    lookup_reuse_s has passed, the same offer each time; then a lookup again."""
    h = harness
    h.prefill(FakeRequest("a", tokens(17), h.spec))  # chunks 0-1 of b
    b = FakeRequest("b", tokens(33), h.spec)
    lookups = daemon_lookups(h)
    offers = []
    for _ in range(5):
        offers.append(h.conn.get_num_new_matched_tokens(b, 0))
        now[0] += REUSE_S / 10
    assert offers == [(16, True)] * 5
    assert daemon_lookups(h) == lookups + 1 and h.conn.stats.lookups_reused == 4
    now[0] += REUSE_S
    assert h.conn.get_num_new_matched_tokens(b, 0) == (16, True)
    assert daemon_lookups(h) == lookups + 2
    assert h.admit(b) == (16, True)  # the offer of a reused answer is pinned as any other
    meta, report = h.step()
    assert [t.req_id for t in meta.loads] == ["b"] and not report.load_errors
    h.assert_loaded(b, range(4))


def test_its_first_missing_chunk_stored_by_this_connector_is_looked_up_again(
    harness: Harness,
) -> None:
    """b missed; another request stores b's chunks through this connector: b's next ask, well
    within the bound, looks up again and is offered them (was the stale miss without the
    change marks)."""
    h = harness
    b = FakeRequest("b", tokens(33), h.spec)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (0, False)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (0, False)  # reused
    lookups = daemon_lookups(h)
    h.prefill(FakeRequest("a", tokens(33), h.spec))  # a's own lookup, then its stores
    assert daemon_lookups(h) == lookups + 1
    assert h.conn.get_num_new_matched_tokens(b, 0) == (32, True)
    assert daemon_lookups(h) == lookups + 2


def test_a_hit_found_gone_at_a_pin_makes_the_others_look_again(
    harness: Harness, daemon: DaemonProc
) -> None:
    """b and c were both offered 4 stored chunks; another client evicts the last one (LRU).
    b's pin finds it gone (BlockRemoved); c, asked again within the bound, looks up again
    and is offered 3 chunks instead of the stale 4 (whose pin would fail)."""
    h, spec = harness, harness.spec
    a = FakeRequest("a", tokens(33), spec)
    h.prefill(a)
    b, c = FakeRequest("b", tokens(33), spec), FakeRequest("c", tokens(33), spec)
    assert h.conn.get_num_new_matched_tokens(c, 0) == (32, True)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (32, True)
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.register_namespace(spec)
        filler = [hashlib.sha256(b"fill%d" % i).digest() for i in range(13)]
        assert kv.put(spec.ns_id, filler, [bytes(spec.part_bytes)] * 13).stored == filler
    assert h.conn.get_num_new_matched_tokens(c, 0) == (32, True)  # unseen: the last answer
    lookups = daemon_lookups(h)
    assert h.admit(b) == (32, True)  # pinned: chunk 3 is found gone
    h.step()  # b's load of the chunks left
    assert h.conn.get_num_new_matched_tokens(c, 0) == (24, True)
    assert daemon_lookups(h) == lookups + 2  # b's pin looked the prefix up, then c


def test_its_first_missing_chunk_answered_present_to_a_store_is_looked_up_again(
    harness: Harness, daemon: DaemonProc
) -> None:
    """b missed; another client stores b's chunks (unseen); then this connector plans to store
    the same chunks for c (a local GPU hit: no lookup) and the daemon answers them present:
    b's next ask, within the bound, looks up again and is offered them."""
    h, spec = harness, harness.spec
    b = FakeRequest("b", tokens(33), spec)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (0, False)
    keys = b.chunk_keys()
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        kv.register_namespace(spec)
        assert kv.put(spec.ns_id, keys, [bytes(spec.part_bytes)] * len(keys)).stored == keys
    assert h.conn.get_num_new_matched_tokens(b, 0) == (0, False)  # unseen: the last answer
    c = FakeRequest("c", tokens(33), spec)
    assert h.admit(c, num_local=32, blocks=h.alloc(8)) == (0, False)  # the GPU holds them
    h.step({"c": (c, 1)})  # c's stores planned from chunk 0 ...
    h.step()  # ... and answered: present
    assert h.conn.stats.present_chunks == len(keys)
    lookups = daemon_lookups(h)
    assert h.conn.get_num_new_matched_tokens(b, 0) == (32, True)
    assert daemon_lookups(h) == lookups + 1
