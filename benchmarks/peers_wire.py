"""The peer fetch's wire alone: 32 MiB over loopback TCP, by sending pattern and by the pages
received into, against raw ZMQ between two processes in the same rounds.

Which costs the bytes of a fetch more than raw ZMQ's: the arena pages received into (cold, a
/dev/shm mapping rotating as B's DRAM does; ZMQ receives into heap buffers it reuses) or the
way the bytes are sent? No kvserver protocol runs here, only the transfer:

- senders (a helper process, ``python -m benchmarks.peers_wire serve ...``, sending a batch's
  parts out of a /dev/shm mapping of three batches, a batch after another, as A's arena):
  ``blocking``: one blocking ``sendmsg`` of every part's view (``bench_peers``'s floor's);
  ``loop``: A's own ``PlainIO.send`` (``kvserver/daemon/stream_io.py``) on
  a uvloop loop, as a daemon serves a peer's window (a non-blocking ``sendmsg`` of the views,
  the rest of a view the socket did not take awaited with ``sock_sendall``, again); ``zmq``:
  the raw ZMQ pair itself, a second instance of the reference (``zmq:heap``: into its own
  buffers), so that it can be pinned too; ``splice``: no copy on the sender's CPU, the
  parts' pages ``vmsplice``d into a pipe of ``/proc/sys/fs/pipe-max-size`` and the pipe
  ``splice``d into the blocking socket, again (``benchmarks/harness/splice.py``);
- destinations (this process, one ``recvmsg_into(MSG_WAITALL)`` per ``IOV_MAX`` views, as B's
  receiving thread): ``rotate``: a /dev/shm mapping of B's 48 MiB, each batch a third further
  (B's pages, and the floor's); ``same``: the same 32 MiB of that mapping every round;
  ``heap``: one 32 MiB bytearray reused every round (warm, as ZMQ's reused buffers);
- placement (optional third field): ``same``: the sender and the receiving thread (ZMQ's:
  its I/O threads) pinned to one CPU (they take turns; the receiver copies what the sender
  just wrote, from that CPU's caches); ``split``: pinned to two CPUs; none: where the
  scheduler puts them (the daemons' case);
- the reference: ``bench_peers``'s raw ZMQ pair (``benchmarks/harness/raw_zmq.py``), unchanged
  and never pinned (this process's receiving thread is pinned during a case's round only).

Every round runs the reference and each case once (cases named SENDER:DEST[:PIN]); per case the
median ms per 32 MiB, reference / case (median over median, and the median of each round's
pair), and the CPU per round (``/proc/PID/task/*/schedstat``, all threads) of the receiving
process (this one: the kernel's copy into the pages and the TCP receive work, or ZMQ's I/O
thread's) and of the sender's, the reference's included, with the sender's user / system
split over all the timed rounds (``/proc/PID/stat``, sampled per tick: a sum over many rounds
only). Wall times need quiet cores; the CPU per round much less so.

Usage::

    python benchmarks/peers_wire.py [--parts 1MiB,256KiB] [--rounds 20]
        [--cases blocking:rotate,loop:rotate,loop:rotate:same,loop:rotate:split,zmq:heap:split,
                 splice:rotate:same,splice:rotate:split]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.proc import runtime_ms, ticks
from benchmarks.harness.raw_tcp import shm_mapping
from benchmarks.harness.raw_zmq import RawPeer
from kvserver.daemon.config_parse import parse_size
from kvserver.daemon.malloc import MALLOC_ENV, tune_malloc

MiB = 1 << 20
BATCH_BYTES = 32 * MiB
B_DRAM = 48 * MiB
IOV_MAX = 1024
SENDERS = ("blocking", "loop", "zmq", "splice")
DESTS = ("rotate", "same", "heap")
PINS = ("", "same", "split")
DEFAULT_CASES = "blocking:rotate,loop:rotate,loop:same,loop:heap"
#: every byte the senders send (their mapping is filled with it): the receiver checks it.
FILL = 0x07


def serve(port_file: str, part_bytes: int, n: int, sender: str) -> int:
    """Helper process: per request byte b"g", a batch of ``n`` parts sent as ``sender`` says
    out of a /dev/shm mapping of three batches (a batch after another); b"s" stops it."""
    batch = n * part_bytes
    mapping = shm_mapping(3 * batch)
    arena = memoryview(mapping)
    arena[:] = bytes([FILL]) * (3 * batch)
    listener = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def views(r: int) -> list[memoryview]:
        base = (r % 3) * batch
        return [arena[base + i * part_bytes : base + (i + 1) * part_bytes] for i in range(n)]

    if sender == "loop":
        import uvloop

        from kvserver.daemon.stream_io import PlainIO

        conn.setblocking(False)
        io = PlainIO(conn, 30.0)
        loop = uvloop.new_event_loop()

        async def answer() -> None:
            r = 0
            while await loop.sock_recv(conn, 1) == b"g":
                await io.send(views(r))
                r += 1

        loop.run_until_complete(answer())
    elif sender == "splice":
        from benchmarks.harness.splice import SpliceSender, address

        start, out, r = address(mapping), SpliceSender(conn.fileno()), 0
        while conn.recv(1) == b"g":
            base = start + (r % 3) * batch
            out.send([(base + i * part_bytes, part_bytes) for i in range(n)])
            r += 1
        out.close()
    else:
        rounds = 0
        while conn.recv(1) == b"g":
            left = views(rounds)
            while left:
                sent = conn.sendmsg(left[:IOV_MAX])
                while left and sent >= left[0].nbytes:
                    sent -= left.pop(0).nbytes
                if left and sent:
                    left[0] = left[0][sent:]
            rounds += 1
    return 0


def _pin_all(pid: int, tids: set[str], cpu: int) -> None:
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), {cpu})


class Case:
    """One sender (a helper process) and this process's receiving end into ``dest``: the
    sender ``zmq`` is the raw ZMQ pair itself (``dest`` ``heap``: its own buffers), pinned
    like the others when asked (the reference, apart from the cases, never is)."""

    def __init__(self, name: str, workdir: Path, part_bytes: int, env: dict[str, str]) -> None:
        sender, _, dest = name.partition(":")
        dest, _, self.pin = dest.partition(":")
        if (sender not in SENDERS or dest not in DESTS or self.pin not in PINS
                or (sender == "zmq" and dest != "heap")):  # fmt: skip
            raise ValueError(f"a case is SENDER:DEST[:PIN], {SENDERS} x {DESTS} x {PINS} "
                             f"(zmq: heap only): {name!r}")  # fmt: skip
        cpus = sorted(os.sched_getaffinity(0))
        if self.pin and len(cpus) < 2:
            raise ValueError(f"{name!r}: pinning needs two CPUs")
        #: the receiving end's CPU and the sender's (None: not pinned)
        self.cpus = (cpus[0], cpus[0] if self.pin == "same" else cpus[1]) if self.pin else None
        self.name, self.dest, self.part_bytes = name, dest, part_bytes
        self.n = BATCH_BYTES // part_bytes
        self.rounds = 0
        self.receiver_ms: list[float] = []
        self.sender_ms: list[float] = []
        self.zmq: RawPeer | None = None
        self.mine: set[str] = set()  # this process's threads of the receiving end
        if sender == "zmq":
            before = set(os.listdir("/proc/self/task"))
            self.zmq = RawPeer(workdir, part_bytes, self.n, env, 30_000)
            self.mine = set(os.listdir("/proc/self/task")) - before  # its context's threads
            self.proc = self.zmq.proc
            if self.cpus is not None:
                _pin_all(self.proc.pid, set(os.listdir(f"/proc/{self.proc.pid}/task")),
                         self.cpus[1])  # fmt: skip
                _pin_all(os.getpid(), self.mine, self.cpus[0])
            return
        self.port_file = workdir / f"{sender}-{dest}-{self.pin}-{part_bytes}.port"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers_wire", "serve", str(self.port_file),
             str(part_bytes), str(self.n), sender,
             "" if self.cpus is None else str(self.cpus[1])],
            cwd=Path(__file__).resolve().parents[1], env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the {sender} sender did not start")
            time.sleep(0.02)  # waiting for the helper's port file, bounded by the deadline
        port = int(self.port_file.read_text())
        self.sock = socket.create_connection(("127.0.0.1", port), 30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(30)
        self.buf = memoryview(bytearray(BATCH_BYTES) if dest == "heap" else shm_mapping(B_DRAM))

    def round(self) -> float:
        every = os.sched_getaffinity(0)
        if self.cpus is not None:  # this thread, for this round only
            os.sched_setaffinity(0, {self.cpus[0]})
        me, sender = runtime_ms(os.getpid()), runtime_ms(self.proc.pid)
        start = time.perf_counter()
        if self.zmq is not None:
            self.zmq.round()
        else:
            self._receive()
        elapsed = time.perf_counter() - start
        self.receiver_ms.append(runtime_ms(os.getpid()) - me)
        self.sender_ms.append(runtime_ms(self.proc.pid) - sender)
        os.sched_setaffinity(0, every)
        return elapsed

    def _receive(self) -> None:
        size = self.part_bytes
        base = (self.rounds % 3) * (B_DRAM // 3) if self.dest == "rotate" else 0
        self.rounds += 1
        span = len(self.buf)
        views = [self.buf[(base + i * size) % span :][:size] for i in range(self.n)]
        last = views[-1]
        self.sock.sendall(b"g")
        while views:
            got = self.sock.recvmsg_into(views[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
            if got == 0:
                raise ConnectionError(f"{self.name}: the sender closed the connection")
            while views and got >= views[0].nbytes:
                got -= views.pop(0).nbytes
            if views and got:
                views[0] = views[0][got:]
        assert last[0] == last[-1] == FILL, f"{self.name}: other bytes arrived"

    def close(self) -> None:
        if self.zmq is not None:
            self.zmq.close()
            return
        self.sock.sendall(b"s")
        self.proc.wait(30)
        self.sock.close()


def measure(part_bytes: int, rounds: int, cases: list[str], workdir: Path) -> dict[str, Any]:
    env = dict(os.environ, **MALLOC_ENV)
    n = BATCH_BYTES // part_bytes
    ref = RawPeer(workdir, part_bytes, n, env, 30_000)
    running: dict[str, Case] = {}
    times: dict[str, list[float]] = {"ref": [], **{c: [] for c in cases}}
    ref_cpu: dict[str, list[float]] = {"receiver": [], "sender": []}
    load_before = os.getloadavg()[0]
    senders = {"ref": ref.proc.pid}
    user_sys: dict[str, list[tuple[int, int]]] = {}
    try:
        for c in cases:
            running[c] = Case(c, workdir, part_bytes, env)
            senders[c] = running[c].proc.pid
        for r in range(rounds + 2):  # two rounds of warm-up
            if r == 2:
                user_sys = {name: [ticks(pid)] for name, pid in senders.items()}
            for name in times:
                if name != "ref":
                    seconds = running[name].round()
                else:
                    me, sender = runtime_ms(os.getpid()), runtime_ms(ref.proc.pid)
                    seconds = ref.round()
                    ref_cpu["receiver"].append(runtime_ms(os.getpid()) - me)
                    ref_cpu["sender"].append(runtime_ms(ref.proc.pid) - sender)
                if r >= 2:
                    times[name].append(seconds)
        for name, pid in senders.items():
            user_sys[name].append(ticks(pid))
    finally:
        ref.close()
        for case in running.values():
            case.close()
    ref_ms = statistics.median(times["ref"]) * 1e3
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")

    def split(name: str) -> dict[str, float]:  # the sender's, per timed round
        (u0, s0), (u1, s1) = user_sys[name]
        return {"user": (u1 - u0) * tick_ms / rounds, "sys": (s1 - s0) * tick_ms / rounds}

    out: dict[str, Any] = {
        "part_bytes": part_bytes, "rounds": rounds, "reference_ms": ref_ms,
        "reference_receiver_cpu_ms": statistics.median(ref_cpu["receiver"][2:]),
        "reference_sender_cpu_ms": statistics.median(ref_cpu["sender"][2:]),
        "reference_sender_user_sys_ms": split("ref"),
        "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
        "cases": {},
    }  # fmt: skip
    for c in cases:
        ms = statistics.median(times[c]) * 1e3
        pairs = zip(times["ref"], times[c], strict=True)
        out["cases"][c] = {
            "ms": ms,
            "ratio": ref_ms / ms,
            "paired_ratio": statistics.median(r / t for r, t in pairs),
            "receiver_cpu_ms": statistics.median(running[c].receiver_ms[2:]),
            "sender_cpu_ms": statistics.median(running[c].sender_ms[2:]),
            "sender_user_sys_ms": split(c),
        }
    return out


def _user_sys(row: dict[str, float]) -> str:
    return f"{row['user']:.2f}/{row['sys']:.2f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        if argv[5:6] and argv[5]:  # the CPU the sender is pinned to
            os.sched_setaffinity(0, {int(argv[5])})
        return serve(argv[1], int(argv[2]), int(argv[3]), argv[4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="1MiB,256KiB", help="part sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"default {DEFAULT_CASES}")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    tune_malloc()  # this process receives the reference's frames: tuned as B is
    cases = args.cases.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvserver-peers-wire-") as tmp:
        for text in args.parts.split(","):
            result = measure(parse_size(text), args.rounds, cases, Path(tmp))
            results.append(result)
            load = (result["load_average_before"], result["load_average_after"])
            print(f"{result['part_bytes'] >> 10} KiB parts, load {load[0]:.2f} -> {load[1]:.2f}: "
                  f"raw ZMQ {result['reference_ms']:.2f} "
                  f"ms, receiver CPU {result['reference_receiver_cpu_ms']:.2f} ms, sender CPU "
                  f"{result['reference_sender_cpu_ms']:.2f} ms (user/sys "
                  f"{_user_sys(result['reference_sender_user_sys_ms'])})")  # fmt: skip
            for c, row in result["cases"].items():
                print(f"  {c:16s} {row['ms']:6.2f} ms  ref/case {row['ratio']:.2f} (paired "
                      f"{row['paired_ratio']:.2f})  receiver CPU {row['receiver_cpu_ms']:.2f} ms"
                      f"  sender CPU {row['sender_cpu_ms']:.2f} ms (user/sys "
                      f"{_user_sys(row['sender_user_sys_ms'])})")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "peers_wire", "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
