"""Runs of whole blocks copied by numpy (worker/block_runs.py): which runs merge, byte-exact
copies of merged runs against a reference built from the canonical torch views, the evenly
spaced layers seen as one array, and whole transfers of chunks that continue each other
through the planner and the real CPU engine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.worker.staged_scenarios import LAYOUTS, caches_on  # noqa: E402
from worker.block_runs import BlockRun, KVArrays, merged, run_block_runs  # noqa: E402
from worker.layout import CanonicalKVCaches, canonicalize, plan_copies  # noqa: E402
from worker.transfer import Direction, Transfer  # noqa: E402
from worker.transfer_cpu import CpuTransferEngine  # noqa: E402


def arrays(c: CanonicalKVCaches) -> KVArrays:
    assert c.arrays is not None
    return c.arrays


def block(c: CanonicalKVCaches, b: int) -> bytes:
    return b"".join(v[b].numpy().tobytes() for v in c.views)


def blocks(c: CanonicalKVCaches) -> list[bytes]:
    return [block(c, b) for b in range(c.num_blocks)]


def spans(runs: list[BlockRun]) -> list[tuple[int, int, int]]:
    return [(first, count, at) for _, _, first, count, at, _ in merged(runs)]


def test_only_neighbours_that_continue_on_both_sides_merge() -> None:
    """Joined: the next block and the next host byte, same arrays and direction. Kept apart:
    a gap on either side, another host, the other direction, and a run that continues one
    that is not its neighbour."""
    c = caches_on("flash", 16, 0, "cpu")
    kv, bb = arrays(c), c.block_bytes
    host, other = torch.zeros(20 * bb, dtype=torch.uint8).numpy(), torch.zeros(20 * bb).numpy()

    def run(first: int, count: int, at_block: int, h: object = host, load: bool = False
            ) -> BlockRun:  # fmt: skip
        return BlockRun(kv, h, first, count, at_block * bb, load)  # type: ignore[arg-type]

    assert spans([run(2, 2, 0), run(4, 3, 2), run(7, 1, 5)]) == [(2, 6, 0)]
    assert spans([run(2, 2, 0), run(4, 1, 3)]) == [(2, 2, 0), (4, 1, 3 * bb)]  # host gap
    assert spans([run(2, 2, 0), run(5, 1, 2)]) == [(2, 2, 0), (5, 1, 2 * bb)]  # block gap
    assert len(spans([run(2, 2, 0), run(4, 1, 2, h=other)])) == 2
    assert len(spans([run(2, 2, 0), run(4, 1, 2, load=True)])) == 2
    assert spans([run(2, 2, 0), run(9, 1, 9), run(4, 1, 2)]) == [
        (2, 2, 0), (9, 1, 9 * bb), (4, 1, 2 * bb)
    ]  # fmt: skip


def test_layers_cut_from_one_allocation_are_one_array() -> None:
    """Evenly spaced per-layer caches are copied as one (blocks, layers, views, page) array
    whose rows are the layers' own bytes; uneven or separate layers keep one copy each."""
    shared = arrays(caches_on("flash_shared", 8, 0, "cpu"))
    assert shared.spaced is not None and shared.spaced.shape[:2] == (8, 3)
    c = caches_on("flash_shared", 8, 0, "cpu")
    spaced = arrays(c).spaced
    assert spaced is not None
    for b in range(8):
        assert spaced[b].tobytes() == block(c, b)
    assert arrays(caches_on("flash_uneven", 8, 0, "cpu")).spaced is None
    assert arrays(caches_on("cross", 8, 0, "cpu")).spaced is None


def test_layers_registered_against_memory_order_copy_exactly() -> None:
    """Layers evenly spaced downwards in memory (registered last-allocated first): one array
    with a negative layer stride; a store and a load through it move each block's bytes."""
    alloc = torch.randint(0, 256, (3, 2, 8, 2, 2, 8), dtype=torch.uint8)
    c = canonicalize({f"l{i}": alloc[2 - i] for i in range(3)}, 8, block_dim=1)
    kv, bb = arrays(c), c.block_bytes
    assert kv.spaced is not None and kv.spaced.strides[1] < 0
    want = blocks(c)
    host = torch.zeros(4 * bb, dtype=torch.uint8)
    run_block_runs([BlockRun(kv, host.numpy(), 5, 2, bb, False)])
    assert host.numpy().tobytes() == bytes(bb) + want[5] + want[6] + bytes(bb)
    run_block_runs([BlockRun(kv, host.numpy(), 0, 3, 0, True)])
    assert blocks(c) == [bytes(bb), want[5], want[6], *want[3:]]


@dataclass
class Runs:
    kind: str
    nb: int
    host_blocks: int
    is_load: bool
    runs: list[tuple[int, int, int, int, int]]  # (first, count, host block, shift, host)
    seed: int


@st.composite
def run_lists(draw: st.DrawFn) -> Runs:
    """Runs of one direction, each continuing the one before it or starting anywhere (blocks
    repeat across runs: a load's later run must win), in one of two hosts, at host offsets a
    whole number of blocks plus a shift (0, 1 or 7 bytes: the engine keeps views of the host
    per offset modulo the block size and per host)."""
    kind = draw(st.sampled_from(LAYOUTS))
    nb, host_blocks = 8, 12
    out: list[tuple[int, int, int, int, int]] = []
    for _ in range(draw(st.integers(1, 8))):
        count = draw(st.integers(1, 3))
        if out and draw(st.booleans()):
            first, n, at, shift, which = out[-1]
            first, at = first + n, at + n
        else:
            first, at = draw(st.integers(0, nb - 1)), draw(st.integers(0, host_blocks - 1))
            shift, which = draw(st.sampled_from([0, 1, 7])), draw(st.integers(0, 1))
        count = min(count, nb - first, host_blocks - at)
        if count > 0:
            out.append((first, count, at, shift, which))
    return Runs(kind, nb, host_blocks, draw(st.booleans()), out, draw(st.integers(0, 99)))


@settings(max_examples=200, deadline=None)
@given(run_lists())
def test_merged_runs_move_the_bytes_of_the_runs_in_order(r: Runs) -> None:
    """Property: copying the runs (merged) leaves the KV blocks and the host exactly as the
    runs copied one at a time, in order, by the canonical torch views would (a store writes
    each block's bytes at its host offset; a load writes the host bytes into the blocks, the
    later run winning)."""
    c = caches_on(r.kind, r.nb, r.seed, "cpu")
    bb = c.block_bytes
    g = torch.Generator().manual_seed(r.seed)
    hosts = [torch.randint(0, 256, (r.host_blocks * bb + 8,), dtype=torch.uint8, generator=g)
             for _ in range(2)]  # fmt: skip
    want_hosts = [bytearray(h.numpy().tobytes()) for h in hosts]
    want_blocks = blocks(c)
    for first, count, at, shift, which in r.runs:
        want_host = want_hosts[which]
        for j in range(count):
            lo = (at + j) * bb + shift
            if r.is_load:
                want_blocks[first + j] = bytes(want_host[lo : lo + bb])
            else:
                want_host[lo : lo + bb] = want_blocks[first + j]
    arrays_ = [h.numpy() for h in hosts]
    run_block_runs([BlockRun(arrays(c), arrays_[which], first, count, at * bb + shift, r.is_load)
                    for first, count, at, shift, which in r.runs])  # fmt: skip
    assert [h.numpy().tobytes() for h in hosts] == [bytes(w) for w in want_hosts]
    assert blocks(c) == want_blocks
    assert spans([BlockRun(arrays(c), arrays_[which], first, count, at * bb + shift, False)
                  for first, count, at, shift, which in r.runs]) == [
        (first, count, at * bb + shift) for first, count, at, shift, _ in _joined(r.runs)
    ]  # fmt: skip


def _joined(runs: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """The runs with each neighbour that continues the one before it joined (the model of
    :func:`merged`)."""
    out: list[tuple[int, int, int, int, int]] = []
    for first, count, at, shift, which in runs:
        if out:
            f, n, a, s, w = out[-1]
            if (first, at, shift, which) == (f + n, a + n, s, w):
                out[-1] = (f, n + count, a, s, w)
                continue
        out.append((first, count, at, shift, which))
    return out


@st.composite
def prefills(draw: st.DrawFn) -> tuple[str, list[list[int]], list[int], int]:
    """Chunks of 2 blocks whose ids and arena slots mostly continue each other (a prefill
    on a fresh arena), sometimes not; the load puts them back elsewhere."""
    kind = draw(st.sampled_from(LAYOUTS))
    ids: list[list[int]] = []
    slots: list[int] = []
    for _ in range(draw(st.integers(1, 6))):
        if ids and slots[-1] < 11 and draw(st.integers(0, 3)):
            ids.append([ids[-1][-1] + 1, ids[-1][-1] + 2])
            slots.append(slots[-1] + 1)
        else:
            first = draw(st.integers(0, 7)) * 2
            ids.append([first, first + 1])
            slots.append(draw(st.integers(0, 11)))
    return kind, ids, slots, draw(st.integers(0, 99))


@settings(max_examples=100, deadline=None)
@given(prefills())
def test_a_transfer_of_continuing_chunks_round_trips_exactly(
    p: tuple[str, list[list[int]], list[int], int],
) -> None:
    """Store chunks (runs merging across chunks where ids and slots continue) and load them
    back into other blocks through the planner and the CPU engine: the host holds each
    chunk's blocks at its slot, the loaded blocks equal the stored ones, nothing else
    changes."""
    kind, ids, slots, seed = p
    nb = 64
    c = caches_on(kind, nb, seed, "cpu")
    part = 2 * c.block_bytes
    host = torch.zeros(12 * part + 5, dtype=torch.uint8)[5:]
    before = blocks(c)
    last = {s: k for k, s in enumerate(slots)}  # a slot written twice holds the later chunk
    engine = CpuTransferEngine()
    try:
        for is_load in (False, True):
            copies = [
                plan_copies(c, bytes([k]), [b + nb // 2 for b in ids[k]] if is_load else ids[k],
                            2, host, [(slots[k] * part, part)], is_load=is_load)
                for k in last.values()
            ] if is_load else [
                plan_copies(c, bytes([k]), ids[k], 2, host, [(slots[k] * part, part)],
                            is_load=False)
                for k in range(len(ids))
            ]  # fmt: skip
            direction = Direction.LOAD if is_load else Direction.STORE
            t = Transfer(direction, "t", [kc.key for kc in copies], copies)
            engine.submit(t)
            engine.wait([t])
            assert engine.poll() == [t] and not t.failed_keys
            if not is_load:
                for s, k in last.items():
                    got = host[s * part : (s + 1) * part].numpy().tobytes()
                    assert got == before[ids[k][0]] + before[ids[k][1]]
    finally:
        engine.close()
    want = list(before)
    for k in last.values():
        for b in ids[k]:
            want[b + nb // 2] = before[b]
    assert blocks(c) == want
