"""The transfer engines: copies land, ordering per direction, independence of directions,
non-blocking completion, per-key and per-transfer failures. Every test runs on the CPU engine
and again on the CUDA engine when a GPU is present (its CPU twin always runs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from worker.transfer import (  # noqa: E402
    Direction,
    IndexedCopy,
    KeyCopies,
    Transfer,
    TransferEngine,
)
from worker.transfer_cpu import CpuTransferEngine  # noqa: E402
from worker.transfer_factory import make_engine  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ENGINES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[gpu, needs_cuda]),
]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[TransferEngine]:
    e = make_engine(torch.device(request.param))
    yield e
    e.close()


def dev(engine: TransferEngine) -> torch.device:
    return torch.device("cpu") if isinstance(engine, CpuTransferEngine) else torch.device("cuda")


def host(n: int, fill: int = 0) -> torch.Tensor:
    t = torch.full((n,), fill, dtype=torch.uint8)
    return t.pin_memory() if torch.cuda.is_available() else t


def store(key: bytes, src: torch.Tensor, dst: torch.Tensor, **kw: object) -> Transfer:
    return Transfer(Direction.STORE, key, [key], [KeyCopies(key, [(src, dst)])], **kw)  # type: ignore[arg-type]


def drain(engine: TransferEngine, *transfers: Transfer) -> list[Transfer]:
    engine.wait(transfers)
    return engine.poll()


def test_copies_land_and_are_collected_once(engine: TransferEngine) -> None:
    d = dev(engine)
    src = torch.arange(64, dtype=torch.uint8, device=d)
    dst = host(64)
    t = store(b"k", src, dst)
    engine.submit(t)
    assert drain(engine, t) == [t]
    assert engine.poll() == [] and engine.num_inflight == 0
    assert torch.equal(dst, src.cpu()) and not t.failed_keys and t.nbytes == 64
    assert engine.stats.transfers["store"] == 1 and engine.stats.bytes["store"] == 64
    back = torch.zeros(64, dtype=torch.uint8, device=d)
    load = Transfer(Direction.LOAD, "l", [b"k"], [KeyCopies(b"k", [(dst, back)])])
    engine.submit(load)
    assert drain(engine, load) == [load] and torch.equal(back.cpu(), dst)


def test_landed_at_is_stamped_when_the_copies_are_first_seen_landed(
    engine: TransferEngine,
) -> None:
    """``landed_at`` (what a co-located load's lease deadline is checked against) is unset
    while a transfer runs and stamped, once, by the wait or poll that first sees its copies
    landed: never earlier than they landed."""
    d = dev(engine)
    src, dst = host(64, fill=7), torch.zeros(64, dtype=torch.uint8, device=d)
    release = threading.Event()
    returned: list[float] = []

    def prepare() -> list[KeyCopies]:
        release.wait()
        returned.append(time.monotonic())
        return [KeyCopies(b"k", [(src, dst)])]

    t = Transfer(Direction.LOAD, "l", [b"k"], prepare=prepare)
    engine.submit(t)
    assert engine.poll() == [] and t.landed_at is None
    release.set()
    engine.wait([t])
    assert t.landed_at is not None and t.landed_at >= returned[0]
    stamped = t.landed_at
    assert engine.poll() == [t] and t.landed_at == stamped and int(dst.min()) == 7
    polled = Transfer(Direction.LOAD, "p", [b"k"], [KeyCopies(b"k", [(src, dst)])])
    before = time.monotonic()
    engine.submit(polled)
    while not engine.poll():  # collected by poll alone: stamped there
        time.sleep(0.001)
    assert polled.landed_at is not None and polled.landed_at >= before


def test_a_transfer_starts_only_after_the_previous_one_of_its_direction(
    engine: TransferEngine,
) -> None:
    """While store 1 is held inside its body, store 2 has not started and poll reports
    nothing; a load (the other direction) completes meanwhile; then both stores finish, in
    order, and poll never blocked."""
    log: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    def held() -> list[KeyCopies]:
        log.append("s1 start")
        entered.set()
        gate.wait()
        log.append("s1 end")
        return []

    def second() -> list[KeyCopies]:
        log.append("s2 start")
        return []

    s1 = Transfer(Direction.STORE, 1, [], prepare=held)
    s2 = Transfer(Direction.STORE, 2, [], prepare=second)
    engine.submit(s1)
    engine.submit(s2)
    entered.wait()
    d = dev(engine)
    back = torch.zeros(8, dtype=torch.uint8, device=d)
    load = Transfer(Direction.LOAD, 3, [b"x"], [KeyCopies(b"x", [(host(8, 7), back)])])
    engine.submit(load)
    engine.wait([load])
    assert engine.poll() == [load]  # the other direction is independent
    assert log == ["s1 start"] and engine.num_inflight == 2
    gate.set()
    assert drain(engine, s1, s2) == [s1, s2]
    assert log == ["s1 start", "s1 end", "s2 start"]


def test_many_transfers_finish_in_submission_order(engine: TransferEngine) -> None:
    """Each store overwrites the same destination; the last one submitted wins."""
    d = dev(engine)
    dst = host(1 << 16)
    transfers = [
        store(b"k", torch.full((1 << 16,), i, dtype=torch.uint8, device=d), dst) for i in range(20)
    ]
    for t in transfers:
        engine.submit(t)
    engine.wait(transfers)
    assert engine.poll() == transfers
    assert int(dst[0]) == 19 and int(dst[-1]) == 19


def test_a_bad_key_fails_alone(engine: TransferEngine) -> None:
    d = dev(engine)
    good_src, dst = torch.ones(16, dtype=torch.uint8, device=d), host(16)
    t = Transfer(Direction.STORE, "t", [b"good", b"bad", b"planned-bad"], [
        KeyCopies(b"good", [(good_src, dst)]),
        KeyCopies(b"bad", [(torch.ones(3, dtype=torch.uint8, device=d), host(5))]),
        KeyCopies(b"planned-bad", error="extent outside the arena"),
    ])  # fmt: skip
    engine.submit(t)
    drain(engine, t)
    assert t.failed_keys == [b"bad", b"planned-bad"] and int(dst.sum()) == 16
    assert engine.stats.failed_keys["store"] == 2


def test_prepare_and_finish_hooks(engine: TransferEngine) -> None:
    """prepare supplies the copies; finish sees the keys that copied after they landed; an
    exception from either fails every key of the transfer."""
    d = dev(engine)
    src, dst = torch.full((32,), 5, dtype=torch.uint8, device=d), host(32)
    seen: list[tuple[list[bytes], int]] = []
    t = Transfer(
        Direction.STORE, "ok", [b"a"],
        prepare=lambda: [KeyCopies(b"a", [(src, dst)])],
        finish=lambda ok: seen.append((ok, int(dst.sum()))),
    )  # fmt: skip

    def boom(*_: object) -> list[KeyCopies]:
        raise ConnectionError("daemon went away")

    bad_prepare = Transfer(Direction.LOAD, "p", [b"a", b"b"], prepare=boom)
    bad_finish = store(b"c", src, host(32), finish=boom)
    for x in (t, bad_prepare, bad_finish):
        engine.submit(x)
    drain(engine, t, bad_prepare, bad_finish)
    assert seen == [([b"a"], 5 * 32)] and not t.failed_keys
    assert bad_prepare.failed_keys == [b"a", b"b"] and bad_finish.failed_keys == [b"c"]


def test_keys_missing_from_prepared_copies_fail(engine: TransferEngine) -> None:
    t = Transfer(Direction.LOAD, "m", [b"a", b"b"], prepare=lambda: [KeyCopies(b"a")])
    engine.submit(t)
    drain(engine, t)
    assert t.failed_keys == [b"b"]


def test_close_finishes_queued_work_then_refuses(engine: TransferEngine) -> None:
    d = dev(engine)
    dst = host(8)
    t = store(b"k", torch.full((8,), 3, dtype=torch.uint8, device=d), dst)
    engine.submit(t)
    engine.close()
    assert int(dst.sum()) == 24
    with pytest.raises(RuntimeError):
        engine.submit(store(b"k", dst, dst))


class RowByRowEngine(CpuTransferEngine):
    """The CPU engine with the base class's batch and indexed copies (one copy_ per row), as
    an engine without a native gather/scatter (CUDA) runs them."""

    _copy_batch = TransferEngine._copy_batch
    _copy_indexed = TransferEngine._copy_indexed


@pytest.mark.parametrize("engine_cls", [CpuTransferEngine, RowByRowEngine],
                         ids=["native", "row-by-row"])  # fmt: skip
def test_indexed_copies_gather_and_scatter(engine_cls: type[CpuTransferEngine]) -> None:
    """A gather fills dst rows from the indexed src rows; a scatter writes src rows to the
    indexed dst rows and leaves the other rows alone; both run in order with plain copies."""
    e = engine_cls()
    try:
        rows = torch.arange(6 * 4, dtype=torch.uint8).reshape(6, 4)
        gathered = torch.zeros(3, 4, dtype=torch.uint8)
        scattered = torch.full((6, 4), 99, dtype=torch.uint8)
        index = torch.tensor([4, 0, 2])
        tail = torch.zeros(4, dtype=torch.uint8)
        t = Transfer(Direction.STORE, "i", [b"g", b"s"], [
            KeyCopies(b"g", [IndexedCopy(rows, gathered, index, scatter=False),
                             (gathered[0], tail)]),
            KeyCopies(b"s", [IndexedCopy(gathered, scattered, index, scatter=True)]),
        ])  # fmt: skip
        e.submit(t)
        assert drain(e, t) == [t] and not t.failed_keys
        assert torch.equal(gathered, rows[index]) and torch.equal(tail, rows[4])
        assert torch.equal(scattered[index], rows[index])
        assert int(scattered[[1, 3, 5]].min()) == 99 and t.nbytes == 3 * 4 + 4 + 3 * 4
    finally:
        e.close()


def test_transfers_submitted_together_run_as_one_group(engine: TransferEngine) -> None:
    """Inside ``batched()`` nothing starts; at its end the copy-only transfers of a direction
    run as one group (one batch of copies), are each collected once in submission order with
    their own results, and a bad key fails in its own transfer only."""
    d = dev(engine)
    srcs = [torch.full((64,), i + 1, dtype=torch.uint8, device=d) for i in range(6)]
    dsts = [host(64) for _ in srcs]
    ts = [store(bytes([i]), s, t) for i, (s, t) in enumerate(zip(srcs, dsts, strict=True))]
    bad = Transfer(Direction.STORE, "bad", [b"x", b"y"], [
        KeyCopies(b"x", [(torch.ones(3, dtype=torch.uint8, device=d), host(5))]),
        KeyCopies(b"y", [(torch.full((8,), 9, dtype=torch.uint8, device=d), host(8))]),
    ])  # fmt: skip
    ts.insert(3, bad)
    with engine.batched():
        for t in ts:
            engine.submit(t)
        assert all(t.done is False for t in ts)
    assert drain(engine, *ts) == ts
    assert engine.stats.groups["store"] == 1 and engine.stats.grouped_transfers["store"] == 7
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, torch.full((64,), i + 1, dtype=torch.uint8))
    assert bad.failed_keys == [b"x"] and bad.nbytes == 8
    assert all(not t.failed_keys and t.nbytes == 64 for t in ts if t is not bad)


def test_a_transfer_with_hooks_splits_a_group_and_keeps_the_order(
    engine: TransferEngine,
) -> None:
    """prepare/finish transfers run alone, between the groups before and after them: finish
    sees the earlier group's bytes landed, and the later group has not started."""
    d = dev(engine)
    first, later = host(32), host(32)
    seen: list[tuple[int, int]] = []
    ts = [
        store(b"a", torch.full((32,), 2, dtype=torch.uint8, device=d), first),
        store(b"b", torch.full((32,), 2, dtype=torch.uint8, device=d), host(32)),
        store(b"c", torch.full((32,), 1, dtype=torch.uint8, device=d), host(32),
              finish=lambda ok: seen.append((int(first.sum()), int(later.sum())))),
        store(b"d", torch.full((32,), 3, dtype=torch.uint8, device=d), later),
        store(b"e", torch.full((32,), 3, dtype=torch.uint8, device=d), host(32)),
    ]  # fmt: skip
    with engine.batched():
        for t in ts:
            engine.submit(t)
    assert drain(engine, *ts) == ts
    assert seen == [(64, 0)] and not any(t.failed_keys for t in ts)
    assert engine.stats.groups["store"] == 2 and engine.stats.grouped_transfers["store"] == 4


def test_wait_inside_batched_releases_what_is_held(engine: TransferEngine) -> None:
    d = dev(engine)
    dst = host(16)
    t = store(b"k", torch.full((16,), 7, dtype=torch.uint8, device=d), dst)
    with engine.batched():
        engine.submit(t)
        engine.wait([t])  # would never return if what is held stayed held
        assert int(dst.sum()) == 7 * 16
    assert engine.poll() == [t]


def test_a_transfer_is_done_once_its_results_are_written(engine: TransferEngine) -> None:
    """The completion without a future per transfer: ``done`` is None before submit (wait
    skips such a transfer), False while queued, True once the engine's thread has written the
    results; a wait for one transfer returns with every earlier one of its direction done."""
    d = dev(engine)
    never = store(b"n", torch.ones(4, dtype=torch.uint8, device=d), host(4))
    engine.wait([never])  # not submitted: returns at once
    assert never.done is None
    dsts = [host(32) for _ in range(5)]
    ts = [store(bytes([i]), torch.full((32,), i, dtype=torch.uint8, device=d), dst)
          for i, dst in enumerate(dsts)]  # fmt: skip
    with engine.batched():
        for t in ts:
            engine.submit(t)
        assert [t.done for t in ts] == [False] * 5 and engine.poll() == []
    engine.wait([ts[2]])
    assert all(t.done for t in ts[:3])
    assert all(t.nbytes == 32 and not t.failed_keys for t in ts[:3])
    engine.wait(ts)
    assert engine.poll() == ts
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, torch.full((32,), i, dtype=torch.uint8))


def test_a_waiter_that_runs_queued_copies_keeps_the_order_and_leaves_hooks_to_the_engine(
    engine: TransferEngine,
) -> None:
    """A wait may run the copy-only transfers queued at its direction's head on its own
    thread (instead of sleeping until the engine thread has run them); whoever runs what,
    the order holds: a store with a ``finish`` hook between two copy-only stores to the same
    bytes sees the first one's bytes and runs on the direction's thread, and the last store
    wins. Repeated, so that the waiter and the engine thread meet in either order."""
    d = dev(engine)
    for round_ in range(20):
        dst = host(16)
        first = store(b"a", torch.full((16,), 1, dtype=torch.uint8, device=d), dst)
        seen: list[tuple[int, str]] = []
        hooked = store(b"b", torch.full((4,), 9, dtype=torch.uint8, device=d), host(4),
                       finish=lambda ok, dst=dst, seen=seen: seen.append(
                           (int(dst[0]), threading.current_thread().name)))  # fmt: skip
        last = store(b"c", torch.full((16,), 3, dtype=torch.uint8, device=d), dst)
        if round_ % 2:
            with engine.batched():
                for t in (first, hooked, last):
                    engine.submit(t)
        else:
            for t in (first, hooked, last):
                engine.submit(t)
        engine.wait([last])
        assert first.done and hooked.done and last.done
        assert len(seen) == 1 and seen[0][0] == 1 and seen[0][1].startswith("kv-store")
        assert torch.equal(dst, torch.full((16,), 3, dtype=torch.uint8))
        assert engine.poll() == [first, hooked, last]
