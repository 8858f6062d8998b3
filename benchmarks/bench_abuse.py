"""The daemon under abuse: its RSS growth, and the worst stall an authenticated client sees.

Starts a real daemon (loopback, its default random token) and, one abuse at a time:

- ``idle_local``: 100 local-channel connections, each sending a size field announcing 1 GiB
  and a few bytes, then nothing (target: RSS growth < 64 MiB);
- ``grpc_10mb``: 150 sequential 10 MB Lookup requests the daemon refuses (target: < 64 MiB);
- ``unauth_2m``: 2 attacker processes sending unauthenticated lookups of 2^21 keys (a 12 MB
  header) back to back, each waiting for its reply (target: an authenticated lookup < 5 ms);
- ``unauth_2m_reconnecting``: the same, each request on a new connection (a fresh routing id);
- ``unauth_2m_pipelined``: the same without waiting for replies (as fast as ZMQ takes them);
- ``unauth_2m_pipelined_wrong_token``: the same, presenting a wrong token at the handshake
  (PLAIN; each attempt is a ZAP request the daemon answers);
- ``unauth_2m_raw_pipelined``: a peer that writes a ZMTP greeting (NULL) and then its requests
  back to back on a plain TCP socket without reading anything, reconnecting whenever the daemon
  hangs up (the bytes arrive whether the daemon wants them or not);
- ``auth_1m_tokens``: an authenticated attacker sending 1M-token lookup_tokens back to back
  (validated off the loop; past 65,536 ids refused at the header since the packed form);
- ``auth_1m_tokens_packed`` (with ``--only`` only: a daemon that announces
  ``packed_token_ids``): the same prompt packed, one bin of u32 ids;
- ``auth_1m_tokens_grpc``: the same prompt as gRPC Lookups by token ids, back to back.

The contention floors, in the same run: ``busy_2`` (2 busy-loop processes that do not talk to
the daemon) and ``sink_2m`` / ``sink_2m_pipelined`` (the same attackers sending the same
messages to a bare ZMQ ROUTER in another process, which answers each with a short error: the
CPU and memory traffic of the attack without the daemon in it).

While each abuse runs, an authenticated client (the bench process, its token picked up from the
daemon's file) times small ZMQ lookups; the reference is the same lookups with no abuse,
measured in the same run against the same daemon: ratio = p99 under abuse / p99 reference.
Each row also has the CPU the attackers and the daemon's ZMQ I/O thread used (cores), the
1-minute load average, and for attacks on the daemon its ``refusals`` counters. RSS is the
daemon's VmRSS before and after each abuse.

Usage: python benchmarks/bench_abuse.py [--quick] [--only ROW,...] [--json FILE]
(``--only``: the named stall rows and the reference only.) The attackers and the bench process
import nothing of the daemon's tree but the wire format, so this file can be run against an older
checkout (``PYTHONPATH=OLD python3 bench_abuse.py``) for a before/after comparison.
With --json, also writes FILE with the .png suffix (two bar charts) when matplotlib is
importable.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

import grpc
import msgpack
import zmq

from benchmarks.harness.daemon import RECORDED_POLICY, DaemonProc, start_daemon
from benchmarks.report import save_report
from kvserver import wire, wire_local
from kvserver.client import KVClient
from kvserver.daemon.malloc import MALLOC_ENV
from kvserver.namespace import NamespaceSpec

MIB = 1 << 20
SPEC = NamespaceSpec(
    model="bench/abuse", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16
)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def lookup_latencies(kv: KVClient, ns_id: str, seconds: float) -> list[float]:
    """Times of back-to-back authenticated 1-key lookups for ``seconds`` (ms)."""
    keys = [bytes(SPEC.key_size)]
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        kv.lookup(ns_id, keys)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": ordered[-1],
    }


# ----------------------------------------------------------------------------- attackers


def attack(kind: str, address: str, seconds: str, token: str = "") -> None:
    """Run in a child process: send ``kind`` requests back to back for ``seconds``, one
    outstanding (``*_pipelined``: as fast as ZMQ takes them, replies read when they come;
    ``*_reconnecting``: each on a new connection; ``busy``: no requests, a busy loop). Prints
    how many were sent."""
    deadline = time.monotonic() + float(seconds)
    if kind == "busy":
        while time.monotonic() < deadline:
            pass
        print(0, flush=True)
        return

    def deadline_ms() -> int:
        return max(1, int((deadline - time.monotonic()) * 1000))

    if kind == "auth_1m_tokens_grpc":
        print(grpc_attack(address, token.split(":")[0], token.split(":")[1], deadline), flush=True)
        return
    password = "not-the-token" if kind.endswith("_wrong_token") else ""
    args: dict[str, Any]
    if kind.startswith("unauth_2m"):
        args = {"ns_id": "x", "keys": [b"k" * 4] * (1 << 21)}
        frame = msgpack.packb({"v": 1, "id": 1, "op": wire.LOOKUP, "args": args})
    else:  # token: TOKEN:NS_ID:1 when the daemon wants the token at the handshake too
        secret, ns_id, at_handshake = token.split(":")
        token_ids: list[int] = list(range(1 << 20))
        packed = kind == "auth_1m_tokens_packed"  # one bin of u32 ids (packed_token_ids)
        args = {"ns_id": ns_id, "token_ids": array.array("I", token_ids).tobytes() if packed
                else token_ids}  # fmt: skip
        frame = wire.encode_request(1, wire.LOOKUP_TOKENS, args, auth=secret)
        password = secret if at_handshake == "1" else ""
    sent = 0
    if "_raw" in kind:
        print(raw_attack(address, frame, deadline), flush=True)
        return
    sock = dealer(address, password)
    if "_pipelined" in kind:
        sock.sndhwm = 4  # a few 12 MB messages queued: the daemon, not the queue, sets the pace
        while time.monotonic() < deadline:
            while sock.poll(0, zmq.POLLIN):
                sock.recv_multipart()
            if sock.poll(100, zmq.POLLOUT):
                try:  # (the connection may be gone again: a refused handshake)
                    sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                    sent += 1
                except zmq.Again:
                    continue
        print(sent, flush=True)
        return
    while time.monotonic() < deadline:
        if kind.endswith("_reconnecting"):  # a new connection (routing id) for every request
            sock.close()
            sock = dealer(address, password)
        if not sock.poll(deadline_ms(), zmq.POLLOUT):
            break  # no connection to send on (refused at the handshake)
        try:
            sock.send(frame, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the connection went again (a refused handshake)
            continue
        if not sock.poll(deadline_ms()):
            break
        sock.recv_multipart()
        sent += 1
    print(sent, flush=True)


def grpc_attack(address: str, secret: str, ns_id: str, deadline: float) -> int:
    """Authenticated gRPC Lookups of a 1M-token prompt back to back until ``deadline``."""
    from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb

    req = pb.LookupRequest(namespace_id=ns_id)
    req.tokens.token_ids.extend(range(1 << 20))
    raw = req.SerializeToString()
    sent = 0
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary("/kvserver.v1.KVServer/Lookup")
        metadata = (("authorization", f"Bearer {secret}"),)
        while time.monotonic() < deadline:
            call(raw, metadata=metadata, timeout=max(0.1, deadline - time.monotonic() + 5))
            sent += 1
    return sent


def dealer(address: str, password: str = "") -> zmq.Socket[bytes]:
    """A DEALER to ``address``: no credentials, or PLAIN with ``password``."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if password:
        sock.plain_username = b"kvserver"
        sock.plain_password = password.encode()
    sock.connect(address)
    return sock


def zmtp_null_hello() -> bytes:
    """What a ZMTP 3.0 DEALER with the NULL mechanism sends first: greeting + READY."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    return greeting + bytes([0x04, len(ready)]) + ready


def raw_attack(address: str, frame: bytes, deadline: float) -> int:
    """Write ``frame`` as ZMTP messages back to back behind a NULL greeting, reading nothing,
    until ``deadline``; reconnect when the daemon hangs up. Returns the messages written."""
    import socket

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    message = b"\x02" + len(frame).to_bytes(8, "big") + frame  # a long, last frame
    sent = 0
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0) as conn:
                conn.sendall(zmtp_null_hello())
                while time.monotonic() < deadline:
                    conn.sendall(message)
                    sent += 1
        except OSError:  # refused, reset, or not read within 1 s: a new connection
            continue
    return sent


def sink() -> None:
    """Run in a child process: a bare ROUTER answering every message with a short error, the
    same work as the daemon's for an unauthenticated request; prints its port, runs until
    killed. The attack sent here instead of the daemon is the contention floor."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    error = wire.encode_error(0, "sink", "unauthenticated", "missing or wrong auth token")
    while True:
        msg = sock.recv_multipart(copy=False)
        sock.send_multipart([msg[0].bytes, error])


def spawn_attackers(kind: str, address: str, n: int, seconds: float, token: str) -> list[Any]:
    return [
        subprocess.Popen(
            [sys.executable, __file__, "attack", kind, address, str(seconds), token],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **MALLOC_ENV},  # the daemon's allocator settings
        )
        for _ in range(n)
    ]


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each thread of ``pid`` used so far, by thread name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


# ----------------------------------------------------------------------------- abuses


def idle_local(d: DaemonProc) -> dict[str, Any]:
    import socket

    conns = []
    before = rss(d.proc.pid)
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(f"{d.arena_path}.sock")
        s.sendall(wire_local.SIZE.pack(1 << 30) + bytes(4000))
        conns.append(s)
    time.sleep(1.0)  # let the daemon read what they sent (nothing to wait on: they are idle)
    grew = rss(d.proc.pid) - before
    for s in conns:
        s.close()
    return {"rss_growth_mib": grew / MIB, "target_mib": 64}


def grpc_10mb(d: DaemonProc) -> dict[str, Any]:
    body = bytes([0x0A]) + b"\xff" * 3 + bytes(10_000_000)
    token = d.token
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(
        d.grpc_address, options=[("grpc.max_send_message_length", 64 * MIB)]
    ) as channel:
        lookup = channel.unary_unary("/kvserver.v1.KVServer/Lookup")
        codes = set()
        before = rss(d.proc.pid)
        for _ in range(150):
            try:
                lookup(body, timeout=30, metadata=metadata)
            except grpc.RpcError as exc:
                codes.add(exc.code().name)
        grew = rss(d.proc.pid) - before
    return {"rss_growth_mib": grew / MIB, "target_mib": 64, "codes": sorted(codes)}


def under_attack(
    d: DaemonProc,
    kv: KVClient,
    ns_id: str,
    kind: str,
    n: int,
    seconds: float,
    token: str = "",
    address: str = "",
) -> dict[str, Any]:
    """Authenticated lookups while ``n`` ``kind`` children run (sending to ``address``, by
    default the daemon); CPU use in cores: the children, and the daemon's ZMQ I/O thread."""
    before = rss(d.proc.pid)
    procs = spawn_attackers(kind, address or d.zmq_address, n, seconds + 1.0, token)
    time.sleep(0.5)  # the attackers' first requests are under way
    kids0 = sum(sum(cpu_seconds(p.pid).values()) for p in procs)
    daemon0 = cpu_seconds(d.proc.pid)
    start = time.monotonic()
    load = os.getloadavg()[0]
    samples = lookup_latencies(kv, ns_id, seconds)
    wall = time.monotonic() - start
    kids1 = sum(sum(cpu_seconds(p.pid).values()) for p in procs)
    daemon1 = cpu_seconds(d.proc.pid)
    sent = 0
    for p in procs:
        out, _ = p.communicate(timeout=120)
        sent += int(out.strip() or 0)
    io = [name for name in daemon1 if name.startswith("ZMQbg/IO")]
    return {
        **summary(samples),
        "attack_requests": sent,
        "rss_growth_mib": (rss(d.proc.pid) - before) / MIB,
        "load_1min": load,
        "attackers_cores": (kids1 - kids0) / wall,
        "daemon_zmq_io_cores": sum(daemon1[k] - daemon0.get(k, 0.0) for k in io) / wall,
        "daemon_cores": (sum(daemon1.values()) - sum(daemon0.values())) / wall,
    }


def refusals(kv: KVClient) -> dict[str, int]:
    """The daemon's ``refusals`` and ``handshakes`` counters (``handshake_*``; none from a
    daemon older than them)."""
    stats = kv.stats()
    out = dict(stats.get("refusals") or {})
    out.update({f"handshake_{k}": v for k, v in (stats.get("handshakes") or {}).items()})
    return out


#: the stall rows: (name, child kind, children, sent to the sink instead of the daemon)
STALLS = (
    ("busy_2", "busy", 2, False),
    ("sink_2m", "unauth_2m", 2, True),
    ("unauth_2m", "unauth_2m", 2, False),
    ("unauth_2m_reconnecting", "unauth_2m_reconnecting", 2, False),
    ("sink_2m_pipelined", "unauth_2m_pipelined", 2, True),
    ("unauth_2m_pipelined", "unauth_2m_pipelined", 2, False),
    ("unauth_2m_pipelined_wrong_token", "unauth_2m_pipelined_wrong_token", 2, False),
    ("unauth_2m_raw_pipelined", "unauth_2m_raw_pipelined", 2, False),
)


def run(quick: bool, only: frozenset[str] = frozenset()) -> dict[str, Any]:
    seconds = 2.0 if quick else 6.0
    with tempfile.TemporaryDirectory() as tmp:
        d = start_daemon(Path(tmp), "--dram", "64MiB", *RECORDED_POLICY)
        sink_proc = subprocess.Popen(
            [sys.executable, __file__, "sink"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **MALLOC_ENV},
        )
        try:
            assert sink_proc.stdout is not None
            sink_address = f"tcp://127.0.0.1:{sink_proc.stdout.readline().strip()}"
            with KVClient(d.zmq_address, colocated=False) as kv:
                ns_id = kv.register_namespace(SPEC).ns_id
                lookup_latencies(kv, ns_id, 0.5)  # warm-up
                results: dict[str, Any] = {}
                results["reference"] = under_attack(d, kv, ns_id, "busy", 0, seconds)
                if not only:
                    results["idle_local"] = idle_local(d)
                    results["grpc_10mb"] = grpc_10mb(d)
                for name, kind, n, to_sink in STALLS:
                    if only and name not in only:
                        continue
                    before = refusals(kv)
                    address = sink_address if to_sink else ""
                    row = under_attack(d, kv, ns_id, kind, n, seconds, address=address)
                    if not to_sink and kind != "busy":
                        after = refusals(kv)
                        row["refusals"] = {k: after[k] - before.get(k, 0) for k in after}
                    results[name] = row
                if not only or "auth_1m_tokens" in only:
                    at_handshake = int("handshakes" in kv.stats())  # (an older daemon: no)
                    token = f"{d.token}:{ns_id}:{at_handshake}"
                    results["auth_1m_tokens"] = under_attack(
                        d, kv, ns_id, "auth_1m_tokens", 1, seconds, token
                    )
                if only and "auth_1m_tokens_packed" in only:  # (a daemon announcing it)
                    token = f"{d.token}:{ns_id}:1"
                    results["auth_1m_tokens_packed"] = under_attack(
                        d, kv, ns_id, "auth_1m_tokens_packed", 1, seconds, token
                    )
                if not only or "auth_1m_tokens_grpc" in only:
                    results["auth_1m_tokens_grpc"] = under_attack(
                        d, kv, ns_id, "auth_1m_tokens_grpc", 1, seconds,
                        f"{d.token}:{ns_id}:0", d.grpc_address,
                    )  # fmt: skip
                ref = results["reference"]["p99_ms"]
                for name in STALL_ROWS:
                    if name in results:
                        results[name]["ratio_p99"] = results[name]["p99_ms"] / ref
        finally:
            sink_proc.kill()
            sink_proc.wait()
            d.terminate()
    return results


#: the rows timed against the reference
STALL_ROWS = (
    *(row[0] for row in STALLS),
    "auth_1m_tokens",
    "auth_1m_tokens_packed",
    "auth_1m_tokens_grpc",
)
ROWS = ("idle_local", "grpc_10mb", *STALL_ROWS)


def print_table(r: dict[str, Any]) -> None:
    ref = r["reference"]
    print(
        f"reference (no abuse): authenticated lookup p50 {ref['p50_ms']:.3f} ms, "
        f"p99 {ref['p99_ms']:.3f} ms, max {ref['max_ms']:.3f} ms ({ref['n']} lookups, "
        f"load {ref['load_1min']:.1f})"
    )
    head = ("RSS +MiB", "p99 ms", "max ms", "p99/ref", "sent", "kids cpu", "io cpu", "load")
    print(f"{'abuse':<24} {head[0]:>9} " + " ".join(f"{h:>8}" for h in head[1:]))
    for name in ROWS:
        if name not in r:
            continue
        row = r[name]

        def cell(key: str, fmt: str, row: dict[str, Any] = row) -> str:
            return format(row[key], fmt) if key in row else "-"

        print(
            f"{name:<24} {row['rss_growth_mib']:>9.1f} {cell('p99_ms', '.3f'):>8} "
            f"{cell('max_ms', '.3f'):>8} {cell('ratio_p99', '.2f'):>8} "
            f"{cell('attack_requests', 'd'):>8} {cell('attackers_cores', '.2f'):>8} "
            f"{cell('daemon_zmq_io_cores', '.2f'):>8} {cell('load_1min', '.1f'):>8}"
        )
    for name in ROWS:
        if name in r and "refusals" in r[name]:
            print(f"{name}: daemon refusals {r[name]['refusals']}")


def write_chart(r: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = ["idle_local", "grpc_10mb", "unauth_2m", "unauth_2m_pipelined", "auth_1m_tokens"]
    names = [n for n in names if n in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.2))
    left.bar(names, [r[n]["rss_growth_mib"] for n in names])
    left.axhline(64, color="red", linestyle="--", label="target 64 MiB")
    left.set_ylabel("daemon RSS growth (MiB)")
    left.legend()
    left.tick_params(axis="x", rotation=20)
    lat = [n for n in ("reference", *STALL_ROWS) if n in r]
    right.bar([f"{n} p99" for n in lat], [r[n]["p99_ms"] for n in lat])
    right.bar([f"{n} max" for n in lat], [r[n]["max_ms"] for n in lat])
    right.axhline(5, color="red", linestyle="--", label="target 5 ms")
    right.set_ylabel("authenticated lookup (ms)")
    right.legend()
    right.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "attack":
        attack(*argv[1:])
        return 0
    if argv and argv[0] == "sink":
        sink()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s per abuse instead of 6 s")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON here")
    parser.add_argument("--only", default="", metavar="ROW,...",
                        help="run only these stall rows (and the reference)")  # fmt: skip
    args = parser.parse_args(argv)
    only = frozenset(filter(None, args.only.split(",")))
    unknown = only - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    results = run(args.quick, only)
    print_table(results)
    if args.json is not None:
        save_report(args.json, results, lambda png: write_chart(results, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
