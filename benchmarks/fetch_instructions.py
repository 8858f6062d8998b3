"""Instructions on the critical path of one peer fetch, phase by phase, counted by callgrind
in one process (no sockets): the serial work of both daemons around the bytes of a 32 MiB
fetch of 128 chunks of 256 KiB, or in parts of ``--part-bytes`` (docs/benchmarks.md, "The
critical path of a peer fetch").

Usage (PYTHONPATH selects the tree measured; to measure an older tree, copy this file into its
benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.fetch_instructions [--reps 10] [--policy prefix]
    PYTHONPATH=TREE python -m benchmarks.fetch_instructions --wall     # no valgrind: µs/phase
    PYTHONPATH=TREE python -m benchmarks.fetch_instructions --part-bytes 1MiB   # 32 chunks

Two services in this process: A (120 MiB of DRAM holding the batch) and B (48 MiB, ``bench_
peers``'s B: full after the warm-up, so every fetch evicts 128 chunks) with the network tier
over one configured peer whose stream is a stand-in (its replies announce every key asked
and receive nothing: the bytes are not the subject). A fetch is cut into the phases it runs
one after another, each ended by a call of ``math.gcd`` (``valgrind --dump-before=math_gcd``
writes the counters there; in ``--wall`` mode the clock is read instead):

- ``B ask`` (critical): from B's ``KVService.load`` of 128 keys in no local tier to the
  stream request sent (``PeerTier.promote``, the fetch's claims and plan, the request's
  encoding);
- ``B reserve`` (overlapped: it runs while A serves the request): the window's pages
  reserved (``prepare_store`` with its eviction) and their views;
- ``A serve`` (critical): A's answer to the request, from its header read to the reply's
  head and arena views handed to the socket (the real ``PlainIO``, a stand-in socket: its
  first ``sendmsg``): ``KVService.get(leading=True)``, the leading run, the pins, the views;
- ``A release`` (after the bytes are sent): the pins' end;
- ``B early`` (overlapped: it runs while the window's last chunks are on the wire): the
  window's leading chunks made ready as soon as they have arrived (``Placer.complete_
  early``; 0 in a tree without it, whose stand-in connection is not given ``early``);
- ``B grant`` (critical): from the window's last bytes in B's pages to the load's reply
  encoded (the rest of the window completed and published, the load granted, the reply's 128
  locations encoded).

Prints instructions per fetch and per chunk for each phase, and the serial sum (B ask, the
longer of B reserve and A serve, B grant). Needs valgrind; ~1 minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

PHASES = ("B ask", "B reserve", "A serve", "A release", "B early", "B grant")
#: what runs between two phases' ends, in order, once per fetch (``other``: not counted).
_SEQUENCE = ("other", "B ask", "B reserve", "A serve", "A release", "other", "B early", "B grant")
BATCH_BYTES = 32 << 20
PART_BYTES = 256 << 10  # the default: 128 chunks
A_DRAM = 120 << 20
B_DRAM = 48 << 20
WARMUP = 4
PEER = "tcp://stand-in:1"

_SUMMARY = re.compile(r"^summary: (\d+)$", re.M)
_PART = re.compile(r"^part: (\d+)$", re.M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="fetches counted (default 10)")
    parser.add_argument(
        "--policy", default="prefix", help="DRAM eviction policy (prefix: the recorded figures')"
    )
    parser.add_argument("--wall", action="store_true", help="no valgrind: wall µs per phase")
    parser.add_argument(
        "--part-bytes",
        default="256KiB",
        help="part size of the 32 MiB fetch (default 256KiB: 128 chunks)",
    )
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    from kvserver.daemon.config_parse import parse_size

    part_bytes = parse_size(args.part_bytes)
    if not 0 < part_bytes <= BATCH_BYTES or BATCH_BYTES % part_bytes:
        parser.error("--part-bytes must divide 32MiB")
    chunks = BATCH_BYTES // part_bytes
    if args.wall:
        totals = run(args.reps, args.policy, time.perf_counter, part_bytes)
        for phase in PHASES:
            print(f"{phase:10s} {totals[phase] / args.reps * 1e6:9.1f} us/fetch")
        return
    if args.measured:
        run(args.reps, args.policy, None, part_bytes)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/fetch.out",
        "--dump-before=math_gcd", "--collect-systime=no",
        sys.executable, "-m", "benchmarks.fetch_instructions", "--measured",
        "--reps", str(args.reps), "--policy", args.policy, "--part-bytes", str(part_bytes),
    ]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if not line.startswith("==")]
        raise SystemExit("the measured process failed:\n" + "\n".join(lines[-20:]))
    totals = read_dumps(out, args.reps)
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; policy {args.policy}; "
          f"{chunks} chunks of {part_bytes >> 10} KiB; callgrind files in {out}")  # fmt: skip
    for phase in PHASES:
        ir = totals[phase] / args.reps
        print(f"{phase:10s} {ir / 1e6:8.3f} M instructions/fetch  {ir / chunks / 1e3:7.2f} k/chunk")
    # A serves the request while B reserves the window: the longer of the two is serial
    overlap = max(totals["B reserve"], totals["A serve"])
    critical = (totals["B ask"] + overlap + totals["B grant"]) / args.reps
    print(f"{'serial':10s} {critical / 1e6:8.3f} M (B ask + max(B reserve, A serve) + B grant)")


def read_dumps(out: Path, reps: int) -> dict[str, float]:
    """Sum the dumps of the counted fetches per phase: the last ``reps`` fetches' dumps come
    in ``_SEQUENCE`` order before the one callgrind writes at the process's exit."""
    dumps: list[tuple[int, int]] = []
    for path in out.glob("fetch.out*"):
        text = path.read_text(errors="replace")[:4096]
        part, total = _PART.search(text), _SUMMARY.search(text)
        if part is not None and total is not None:
            dumps.append((int(part.group(1)), int(total.group(1))))
    dumps.sort()
    counted = [ir for _, ir in dumps[-1 - reps * len(_SEQUENCE) : -1]]
    if len(dumps) < 1 + (WARMUP + reps) * len(_SEQUENCE):
        raise SystemExit(
            f"expected {reps * len(_SEQUENCE)} phase dumps in {out}, not {len(counted)}"
        )
    totals = dict.fromkeys(PHASES, 0.0)
    for i, ir in enumerate(counted):
        phase = _SEQUENCE[i % len(_SEQUENCE)]
        if phase != "other":
            totals[phase] += ir
    return totals


class _Marks:
    """Ends phases: ``math.gcd`` (callgrind dumps before it), or the clock's reading."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.last = clock() if clock else 0.0
        self.seen: list[tuple[str, float]] = []

    def __call__(self, phase: str) -> None:
        if self.clock is None:
            math.gcd(12, 18)
            return
        now = self.clock()
        self.seen.append((phase, now - self.last))
        self.last = self.clock()


class _StandInConnection:
    """A peer stream connection: its every reply announces the keys asked, whole (nothing is
    received); it ends the phases around the request and the reply, and has A serve the
    request meanwhile (``serve``)."""

    peer_id = PEER

    def __init__(self, marks: _Marks, serve: Any) -> None:
        self.marks = marks
        self.serve = serve
        self.windows: list[Any] = []

    async def send_requests(self, ns_id: str, windows: Any, deadline: float) -> list[int]:
        from kvserver import wire_stream

        for i, w in enumerate(windows, 1):
            wire_stream.encode_request(wire_stream.FetchRequest(i, ns_id, list(w)))
        self.marks("B ask")
        return list(range(1, len(windows) + 1))

    def start_reply(self, request_id: int, rows: Any, tp: int, part_bytes: int,
                    deadline: float, on_head: Any, *, early: int = 0,
                    on_early: Any = None) -> Any:  # fmt: skip
        self.marks("B reserve")
        self.serve()  # A's answer: "A serve", "A release"
        head = SimpleNamespace(ok=True, count=len(rows), tp=tp, part_bytes=part_bytes)
        on_head(head)
        if on_early is None or not 0 < early < head.count:
            early = 0
        return _StandInJob(head, self.marks, lambda: on_early(early) if early else None)

    def spoil(self) -> None:
        raise AssertionError("the stand-in reply is well formed")


class _StandInJob:
    def __init__(self, head: Any, marks: _Marks, early: Any) -> None:
        self._head = head
        self._marks = marks
        self._early = early

    async def result(self) -> Any:
        self._marks("other")  # the leading chunks are in: "B early" starts
        self._early()  # while the last chunks are on the wire
        self._marks("B early")  # the last bytes are in: "B grant" starts
        return self._head, None

    async def stop(self) -> None:
        return


class _StandInStream:
    timeout_s = 60.0

    def __init__(self, conn: _StandInConnection) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def connection(self) -> Any:
        yield self.conn


class _StandInLink:
    def __init__(self, stream: _StandInStream) -> None:
        self._stream = stream

    async def stream(self) -> _StandInStream:
        return self._stream


class _StandInSocket:
    """A's socket under the real ``PlainIO``: its first ``sendmsg`` (the reply's head and
    the arena views handed over) ends ``A serve``; it takes every byte at once."""

    def __init__(self, marks: _Marks) -> None:
        self.marks = marks
        self.sent = 0

    def sendmsg(self, views: list[memoryview]) -> int:
        self.marks("A serve")
        self.sent += len(views)
        return sum(v.nbytes for v in views)


def run(reps: int, policy: str, clock: Any, part_bytes: int = PART_BYTES) -> dict[str, float]:
    """Run ``WARMUP`` then ``reps`` fetches of 32 MiB in parts of ``part_bytes``; returns the
    seconds per phase (``clock``), or {} (callgrind mode: each phase's end is a ``math.gcd``
    call)."""
    chunks = BATCH_BYTES // part_bytes
    from benchmarks.harness.raw_zmq import payload
    from kvserver import wire, wire_stream
    from kvserver.daemon.auth import Principal
    from kvserver.daemon.peers.book import PeerBook, PeerSettings
    from kvserver.daemon.peers.static import StaticDirectory
    from kvserver.daemon.peers.tier import PeerTier
    from kvserver.daemon.process import settle_gc
    from kvserver.daemon.results import Pending
    from kvserver.daemon.service import KVService
    from kvserver.daemon.stream_io import PlainIO
    from kvserver.daemon.stream_server import StreamServer
    from kvserver.daemon.zmq_ops import _load_reply
    from kvserver.engine.types import EngineConfig
    from kvserver.namespace import NamespaceSpec

    spec = NamespaceSpec(
        model="bench/fetch-instructions", dtype="bfloat16", num_layers=32, num_kv_heads=8,
        head_dim=128, block_size=16, part_bytes_override=part_bytes,
    )  # fmt: skip
    a = KVService(EngineConfig(dram_bytes=A_DRAM, policy=policy))
    b = KVService(EngineConfig(dram_bytes=B_DRAM, policy=policy))
    ns_id = a.register_namespace(spec)["ns_id"]
    b.register_namespace(spec)
    held = [f"held-{i}".encode().ljust(32, b".") for i in range(chunks)]
    for i in range(0, chunks, 8):
        a.put(ns_id, held[i : i + 8], [payload(k, part_bytes) for k in held[i : i + 8]],
              client="bench")  # fmt: skip
    marks = _Marks(None)
    server = StreamServer(a, None, host="127.0.0.1", port=0, timeout_s=60.0)  # type: ignore[arg-type]
    sock = _StandInSocket(marks)
    io = PlainIO(sock, 60.0)  # type: ignore[arg-type]
    admin = Principal("admin")
    loop = asyncio.new_event_loop()

    encoded = wire_stream.encode_request(wire_stream.FetchRequest(1, ns_id, held))
    header = encoded[wire_stream.REQUEST_HEAD.size :]

    def serve() -> None:
        """A answers the window's request (the same 128 keys each time): decoded, then
        ``_answer``, which does not suspend (its keys are in A's DRAM, its socket takes
        everything): driven here to its end, inside B's phases."""
        answer = server._answer(io, wire_stream.decode_request(header), admin)
        with contextlib.suppress(StopIteration):
            answer.send(None)
            raise AssertionError("A's answer suspended")
        marks("A release")

    conn = _StandInConnection(marks, serve)
    book = PeerBook(PeerSettings())
    link = _StandInLink(_StandInStream(conn))
    book.link = lambda peer: link  # type: ignore[method-assign,assignment,return-value]
    tier = PeerTier(b.engine, StaticDirectory([PEER], book), book, publish=b.publish)
    b.stack.add(tier)
    batches = iter(range(1 << 30))
    thresholds = gc.get_threshold()
    settle_gc()  # the daemon's collector settings (a young collection per 10k objects)

    async def fetch() -> None:
        n = next(batches)
        keys = [f"{n}-{i}".encode().ljust(32, b".") for i in range(chunks)]
        marks("other")  # the last fetch's end and these keys
        got = b.load(ns_id, keys, client="bench")
        assert isinstance(got, Pending)
        grant = await got.run()
        reply = _load_reply(grant, False)  # the map form, as recorded (clients now ask packed)
        assert isinstance(reply, dict)
        wire.encode_reply(1, "0123456789abcdef", reply)
        marks("B grant")
        assert len(grant.keys) == chunks, len(grant.keys)
        b.complete_load(grant.lease_id)

    for _ in range(WARMUP):
        loop.run_until_complete(fetch())
    marks.clock = clock
    marks.last = clock() if clock else 0.0
    for _ in range(reps):
        loop.run_until_complete(fetch())
    assert sock.sent == (WARMUP + reps) * (chunks + 1)
    loop.close()
    a.close()
    b.close()
    gc.unfreeze()  # the caller's collector as it was (a test runs this in its process)
    gc.set_threshold(*thresholds)
    if clock is not None:  # the phases ended in the order read_dumps assumes
        assert [p for p, _ in marks.seen] == list(_SEQUENCE) * reps, marks.seen[:8]
    totals = dict.fromkeys(PHASES, 0.0)
    for phase, seconds in marks.seen:
        if phase != "other":
            totals[phase] += seconds
    return totals


if __name__ == "__main__":
    main()
