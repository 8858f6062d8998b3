"""IndexWriter: events coalesce into the commands that leave each set equal to the tier."""

from __future__ import annotations

from typing import Any

import pytest

from kvserver.cluster import schema
from kvserver.cluster.writer import RESYNC_STEP, WRITE_SCRIPT, Batch, IndexWriter
from kvserver.events import MEDIUM_DRAM, MEDIUM_SSD, AllBlocksCleared, BlockRemoved, BlockStored

K = [bytes([i]) * 32 for i in range(6)]
FP = [schema.fingerprint(k) for k in K]


class RecordingPipe:
    """Records queued commands (the writer only queues; the node executes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **kw: self.calls.append((name, *a, *sorted(kw.items())))


def writer() -> IndexWriter:
    return IndexWriter("h", "inc", 1000)


def test_last_event_of_a_key_wins_within_a_batch() -> None:
    w = writer()
    w.add(
        [
            BlockStored(1, "ns", (K[0], K[1]), MEDIUM_DRAM),
            BlockRemoved(2, "ns", (K[1], K[2]), MEDIUM_DRAM),
        ]
    )
    w.add([BlockStored(3, "ns", (K[2],), MEDIUM_DRAM)])
    batch = w.take_batch()
    assert batch is not None and batch.last_seq == 3 and batch.new_namespaces == ("ns",)
    unlink, adds, removes = batch.sets[("ns", "dram")]
    assert (unlink, sorted(adds), removes) == (False, sorted([FP[0], FP[2]]), [FP[1]])
    assert w.take_batch() is None and w.pending_keys == 0


def test_media_map_to_tiers_and_a_clear_empties_the_set_first() -> None:
    w = writer()
    w.add([BlockStored(1, "ns", (K[0],), MEDIUM_SSD), AllBlocksCleared(2, "ns", MEDIUM_DRAM)])
    w.add([BlockStored(3, "ns", (K[3],), MEDIUM_DRAM)])
    batch = w.take_batch()
    assert batch is not None
    assert batch.sets[("ns", "ssd")] == (False, [FP[0]], [])
    assert batch.sets[("ns", "dram")] == (True, [FP[3]], [])
    pipe = RecordingPipe()
    n = w.apply(pipe, batch, 7)
    assert n == len(pipe.calls)
    dram = schema.index_key("h", "inc", "ns", "dram")
    fenced = ("execute_command", "EVAL", WRITE_SCRIPT, 2, dram, schema.fence_key("h", "inc"), 7)
    assert (*fenced, 1000, "u") in pipe.calls
    # SADD and the TTL in one script: a set never exists without its TTL
    assert (*fenced, 1000, "a", FP[3]) in pipe.calls
    # the namespace is claimed once: a later batch does not report it new
    w.add([BlockStored(4, "ns", (K[4],), MEDIUM_DRAM)])
    later = w.take_batch()
    assert later is not None and later.new_namespaces == ()


def test_a_resync_replaces_every_set_and_empties_those_no_longer_held() -> None:
    w = writer()
    w.add([BlockStored(1, "old", (K[0],), MEDIUM_DRAM)])
    w.take_batch()
    w.add([BlockStored(2, "new", (K[1],), MEDIUM_DRAM)])  # pending: dropped by the resync
    batch = w.full_batch({("new", "dram"): [K[5]]}, last_seq=2)
    assert batch.sets[("new", "dram")] == (True, [FP[5]], [])
    assert batch.sets[("old", "dram")] == (True, [], [])
    assert batch.sets[("old", "ssd")] == (True, [], [])
    assert w.pending_keys == 0 and w.namespaces == {"old", "new"}


def test_a_resync_in_steps_fingerprints_at_most_resync_step_keys_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node runs the event loop between a resync's steps: no step fingerprints more than
    RESYNC_STEP keys (1 M keys were one step of ~0.25 s), the first none (it drops what is
    pending), and the batch is the one-step resync's."""
    snapshot = {
        ("a", "dram"): [i.to_bytes(32, "big") for i in range(RESYNC_STEP * 2 + 5)],
        ("a", "ssd"): [],
        ("b", "ssd"): [i.to_bytes(32, "little") for i in range(RESYNC_STEP // 2 + 1)],
    }
    whole = writer().full_batch(snapshot, last_seq=9)
    counted = [0]
    fingerprint = schema.fingerprint

    def counting(key: bytes) -> bytes:
        counted[0] += 1
        return fingerprint(key)

    monkeypatch.setattr(schema, "fingerprint", counting)
    w = writer()
    w.add([BlockStored(1, "a", (K[0],), MEDIUM_DRAM)])
    steps = w.resync(snapshot, last_seq=9)
    per_step = []
    with pytest.raises(StopIteration) as done:
        while True:
            before = counted[0]
            next(steps)
            per_step.append(counted[0] - before)
    per_step.append(counted[0] - before)  # the step that returned
    assert per_step[0] == 0 and w.pending_keys == 0
    assert max(per_step) <= RESYNC_STEP and len(per_step) >= 4, per_step
    assert sum(per_step) == sum(map(len, snapshot.values()))
    assert done.value.value == whole


def test_a_batch_split_into_parts_does_what_it_does_whole() -> None:
    """Parts of at most N keys (a resync of a large daemon goes out as several pipelines):
    each set's unlink in its first part only, every add and remove once, the new namespaces
    in the first part."""
    batch = Batch(
        {
            ("a", "dram"): (True, FP[:5], []),
            ("a", "ssd"): (True, [], []),  # emptied: an unlink and nothing else
            ("b", "dram"): (False, [FP[5]], FP[:3]),
        },
        ("a", "b"),
        7,
    )
    assert batch.split(9) == [batch]
    parts = batch.split(2)
    assert all(p.num_keys <= 2 for p in parts) and all(p.last_seq == 7 for p in parts)
    assert [p.new_namespaces for p in parts] == [("a", "b")] + [()] * (len(parts) - 1)
    unlinks = [s for p in parts for s, (unlink, _, _) in p.sets.items() if unlink]
    assert unlinks == [("a", "dram"), ("a", "ssd")]
    for set_id, (_, adds, removes) in batch.sets.items():
        assert [k for p in parts for k in p.sets.get(set_id, (0, [], []))[1]] == adds
        assert [k for p in parts for k in p.sets.get(set_id, (0, [], []))[2]] == removes
