"""Instructions per batch of 128 chunks on the daemon's store and load paths, counted by
callgrind in one process (no sockets): the per-chunk bookkeeping every store pays, which the
load of a shared machine does not move (docs/benchmarks.md, "Per-chunk costs of the store
path").

Usage (PYTHONPATH selects the tree measured; to measure an older tree, copy this file into its
benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.store_instructions [--reps 50] [--policy prefix]
    PYTHONPATH=TREE python -m benchmarks.store_instructions --wall     # no valgrind: µs/batch

The DRAM tier is B's of ``bench_peers.py``: 48 MiB of 64 KiB pages, chunks of one 256 KiB part,
full after the warm-up, so every batch of 128 new chunks evicts 128 (the steady state of a
daemon that fetches or stores more than it holds). Each kind runs ``--reps`` batches, then
``callgrind_control --dump`` writes its counters; the kinds:

- ``store``: ``prepare_store`` + ``complete_store`` of the whole lease (a co-located put, the
  local channel's path);
- ``put``: ``KVService.put`` of 128 parts (a remote put's daemon work after its frames are
  decoded: reserve, copy each part into the arena, complete; the copies are part of it);
- ``peer fetch``: ``PeerFetches._stream_windows``, the fetching daemon's work for 32 MiB
  fetched over a peer's stream (its windows of ``STREAM_WINDOW_BYTES``: one before the
  pipelined windows, 32 MiB), with a stand-in connection whose replies announce every key
  asked and receive nothing (reserve, the pages' views, completion, the events published);
- ``get``: ``KVService.get(leading=True)`` of 128 READY chunks and the end of its load lease
  (the serving daemon's work for a peer's window: the leading run, the pins, the parts' views);
- ``load``: ``prepare_load`` + ``complete_load`` of 128 READY chunks (a worker's load grant);
- ``copy``: the copies alone of ``put`` (128 parts written into the arena at the pages of
  one earlier grant): ``put`` less ``copy`` is put's bookkeeping.

Prints instructions per batch and per chunk for each kind. Needs valgrind; ~1 minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.harness.callgrind import dump, dump_name, per_call, run_measured

KINDS = ("store", "put", "peer fetch", "get", "load", "copy")
CHUNKS = 128
PART_BYTES = 256 << 10
DRAM_BYTES = 48 << 20
WARMUP_BATCHES = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="batches of each kind (default 50)")
    parser.add_argument(
        "--policy", default="prefix", help="DRAM eviction policy (prefix: the recorded figures')"
    )
    parser.add_argument("--wall", action="store_true", help="no valgrind: wall µs per batch")
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.wall:
        for kind, seconds in run_kinds(args.reps, args.policy, None).items():
            print(f"{kind:12s} {seconds / args.reps * 1e6:9.1f} us/batch")
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    if args.measured:
        run_kinds(args.reps, args.policy, out)
        return
    run_measured(out, "store", "benchmarks.store_instructions", [
        "--measured",
        "--reps", str(args.reps), "--policy", args.policy, "--out", str(out),
    ])  # fmt: skip
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; policy {args.policy}; "
          f"callgrind files in {out}")  # fmt: skip
    for kind, ir in per_call(out, "store.*.*", KINDS).items():
        print(f"{kind:12s} {ir / 1e6:8.3f} M instructions/batch  {ir / CHUNKS / 1e3:7.2f} k/chunk")


class _StandInConnection:
    """A peer stream connection whose every reply announces the keys asked, whole, and whose
    payload is already there (nothing is received: the views are handed over and dropped)."""

    peer_id = "stand-in"

    async def send_requests(self, ns_id: str, windows: Any, deadline: float) -> list[int]:
        return list(range(1, len(windows) + 1))

    def start_reply(self, request_id: int, rows: Any, tp: int, part_bytes: int,
                    deadline: float, on_head: Any, *, early: int = 0,
                    on_early: Any = None) -> Any:  # fmt: skip
        head = SimpleNamespace(ok=True, count=len(rows), tp=1, part_bytes=PART_BYTES)
        on_head(head)
        if on_early is not None and 0 < early < head.count:  # the leading chunks in first
            on_early(early)
        return _StandInJob(head)

    def spoil(self) -> None:
        raise AssertionError("the stand-in reply is well formed")


class _StandInJob:
    def __init__(self, head: Any) -> None:
        self._head = head

    async def result(self) -> Any:
        return self._head, None

    async def stop(self) -> None:
        return


class _StandInStream:
    """A peer stream whose one connection is a :class:`_StandInConnection`."""

    timeout_s = 60.0

    def __init__(self) -> None:
        self.conn = _StandInConnection()

    @contextlib.asynccontextmanager
    async def connection(self) -> Any:
        yield self.conn


def run_kinds(reps: int, policy: str, out: Path | None) -> dict[str, float]:
    """Run every kind ``reps`` times; dump callgrind's counters after each (``out``), or
    return the wall seconds per kind."""
    from kvserver.daemon.peers.book import PeerBook, PeerSettings
    from kvserver.daemon.peers.fetch import STREAM_WINDOW_BYTES, PeerFetches, windows_of
    from kvserver.daemon.results import Pending
    from kvserver.daemon.service import KVService
    from kvserver.engine.types import EngineConfig
    from kvserver.namespace import NamespaceSpec

    spec = NamespaceSpec(
        model="bench/store-instructions",
        dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        part_bytes_override=PART_BYTES,
    )
    service = KVService(EngineConfig(dram_bytes=DRAM_BYTES, policy=policy))
    engine = service.engine
    ns_id = service.register_namespace(spec)["ns_id"]
    parts = [memoryview(bytearray(PART_BYTES)) for _ in range(CHUNKS)]
    loop = asyncio.new_event_loop()
    fetches = PeerFetches(engine, PeerBook(PeerSettings()), publish=service.publish)
    stream = _StandInStream()
    peer = SimpleNamespace(host_id="stand-in")
    batches = iter(range(1 << 30))

    def new_keys() -> list[bytes]:
        b = next(batches)
        return [f"{b}-{i}".encode().ljust(32, b".") for i in range(CHUNKS)]

    def store() -> None:
        grant = engine.prepare_store(ns_id, new_keys(), client="bench")
        assert grant is not None and len(grant.keys) == CHUNKS
        engine.complete_store(grant.lease_id)
        service.publish()

    def put() -> None:
        r = service.put(ns_id, new_keys(), parts, client="bench")
        assert len(r.stored) == CHUNKS

    def peer_fetch() -> None:
        keys = new_keys()
        windows = windows_of([keys], PART_BYTES, STREAM_WINDOW_BYTES)
        run = fetches._stream_windows(spec, peer, stream, windows, (), False)  # type: ignore[arg-type]
        got = loop.run_until_complete(run)
        assert [k for sent, _ in got for k in sent] == keys
        assert engine.lookup(ns_id, keys) == CHUNKS

    held: list[bytes] = []

    def get() -> None:
        got = service.get(ns_id, held, None, client="bench", leading=True)
        assert not isinstance(got, Pending) and len(got.keys) == CHUNKS
        service.complete_load(got.lease_id)

    def load() -> None:
        grant = service.prepare_load(ns_id, held, client="bench")
        service.complete_load(grant.lease_id)

    where: list[Any] = []

    def copy() -> None:
        for extents, part in zip(where, parts, strict=True):
            engine.arena.write(extents[0], part)

    kinds: dict[str, Callable[[], None]] = {
        "store": store, "put": put, "peer fetch": peer_fetch, "get": get, "load": load,
        "copy": copy,
    }  # fmt: skip
    for fn in (store, put, peer_fetch):
        for _ in range(WARMUP_BATCHES):
            fn()
    b = next(batches) - 1  # the batch peer_fetch() placed last: read by get and load
    held[:] = [f"{b}-{i}".encode().ljust(32, b".") for i in range(CHUNKS)]
    assert engine.lookup(ns_id, held) == CHUNKS
    get()
    load()
    pinned = service.prepare_load(ns_id, held, client="bench", lease_s=600)  # ends after "copy"
    where[:] = pinned.locations
    seconds: dict[str, float] = {}
    dump(out, "warm-up")
    # get and load first, while ``held`` is READY; the stores then evict it
    for kind in ("get", "load", "copy", "store", "put", "peer fetch"):
        fn = kinds[kind]
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        seconds[kind] = time.perf_counter() - start
        dump(out, dump_name(KINDS.index(kind), reps))
        if kind == "copy":
            service.complete_load(pinned.lease_id)
    loop.close()
    service.close()
    return seconds


if __name__ == "__main__":
    main()
