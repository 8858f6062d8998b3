"""Network tier: a peer fetch through daemon B, over the peer stream and over ZMQ, against raw
ZMQ between two processes.

Target: peer fetch through another host's daemon >= 0.8x raw ZMQ between two processes.
Everything runs in one run, on loopback:

- the fleet: daemon A (``kvserver start``) holds ``BATCHES`` batches of chunks, stored with
  ``put``; two fetching daemons, each with room for about one and a half batches (so every
  batch is evicted before it is asked for again): B (``--peers A``) fetches over A's peer
  stream (plain TCP, received straight into B's arena: ``docs/wire.md`` §6), B_zmq (``--peers
  A --peer-stream-port -1``) over the ZMQ data plane, as a daemon with CURVE and no TLS
  certificate does.
- peer fetch: this process, a co-located client of B (and of B_zmq), calls ``prepare_load`` of
  one batch's keys (then ``complete_load``). B finds them in no local tier, asks A for them
  straight away (its only peer: no ``lookup local=`` first, ``PeerTier.promote``), fetches
  them in windows pipelined on one connection, checks them and places them in its arena,
  then grants the load. The round trip no longer made is shown beside it: a lookup of the
  batch's keys on A (``lookup_ms_median``, its share of lookup + fetch), and B's directory
  lookups per load (``directory_lookups_per_load``: 0; 1 before). Timed: ``prepare_load``
  returning, i.e. the chunks in B's DRAM ready for the worker to read in place (the worker's
  own copy out of the arena is not part of a fetch).
- reference: raw pyzmq between two processes (``benchmarks/harness/raw_zmq.py``): a helper
  process (``python -m benchmarks.bench_peers serve``) with a ROUTER answers a DEALER request
  from B's stand-in (this process) with the same frames (the same count and sizes, sent
  ``copy=False`` from buffers it allocated in advance, received ``copy=False``), and nothing
  else. The work B does around the same bytes (checks, placing in the arena, the lease) is the
  overhead the ratio shows.
- the floor (context, not the target): the same bytes moved arena pages to arena pages with
  no protocol: a helper process sends them over plain TCP out of a /dev/shm mapping of
  ``BATCHES`` batches (``sendmsg`` of the parts' views, a batch after another, as A's arena),
  and this process receives them with ``recvmsg_into`` (``MSG_WAITALL``, all parts in one
  call) straight into a /dev/shm mapping the size of B's DRAM, rotating as B's pages do. The raw ZMQ
  reference sends from and receives into buffers it reuses every round (hot in the caches);
  any fetch writes into a daemon's arena pages, which are not: ``floor_ratio`` shows what
  that alone costs against the reference.
- context (not the target): the same keys read straight from A with the client's remote
  ``get`` (one hop through kvserver's data plane), in the same rounds.
- a secure fleet, in the same rounds: A_sec (CURVE and a TLS certificate, ``docs/security.md``)
  holds the same batches; B_tls (the same keys) fetches over A_sec's TLS stream port
  (``docs/wire.md`` §6, "TLS"), B_curve (``--peer-stream-port -1``) over ZMQ with CURVE. Their
  ratios against the same raw ZMQ reference (``tls_ratio``, ``curve_ratio``) and against each
  other (``tls_over_curve``) show what encryption costs on each transport.

Each round runs the reference, the floor, the remote get, then the four fetches (their order
rotating from round to round), so all see the same machine; the figure per chunk size is
the median fetch bandwidth over the median reference bandwidth, with the per-round ratios as
the spread (and their median, ``paired_ratio_median``: each fetch round against the reference
round of the same round, which a drifting load on a shared machine disturbs less). The load
average before and after the run is in the report, and the CPU per round (``cpu_ms_median``,
from ``schedstat``) of A and B during the stream fetch and of the reference's two processes:
on loopback a transfer whose two ends the scheduler put on two vCPUs costs its sender about
twice the CPU of one on a shared vCPU, for the reference as for a fetch (docs/benchmarks.md,
"A 1 MiB fetch's wire"), so these show which draw a run had. The summary, the table and the
chart are ``benchmarks/peers_report.py``. Before timing, one fetched batch is read
back through each B and compared byte for byte with what was stored.

Placement (``--placement``, ``benchmarks/harness/placement.py``): which CPUs each side of
every transfer may use, the same for the reference, the floor and every fetch. The receiving
side is this process (B's co-located client, the reference's DEALER, the floor's receiver; its
ZMQ I/O threads included) and the fetching daemons (B, B_zmq, B_tls, B_curve); the sending
side is A, A_sec and the reference's and the floor's helper processes. ``free`` (the default,
today's behaviour): where the scheduler puts each thread, so that the fetch and the reference
each draw their own placement; ``same``: both sides on one CPU; ``split``: the receiving side
on one CPU, the sending side on another; ``all``: each of the three in every run (``--runs``),
the order rotating run by run, summarized per placement. A process is started on its side's
CPUs (it and every thread it starts inherit them), this process's threads are moved to the
receiving side's; after the rounds every thread of every process is read back
(``/proc/PID/task/*/status``, ``Cpus_allowed_list``), checked, and reported (``placement``,
``thread_masks`` per part size).

Usage: python benchmarks/bench_peers.py [--quick] [--runs N] [--parts SIZES] [--rounds N]
       [--stream-window SIZE] [--placement {free,same,split,all}] [--json FILE]
``--stream-window`` is passed to B and B_tls (the fetchers over a stream) as
``--peer-stream-window``: the window sizes can be alternated run by run without editing code.
With --json, also writes FILE with the .png suffix (chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.daemon import RECORDED_POLICY, DaemonProc, start_daemon
from benchmarks.harness.placement import (
    Placement,
    check,
    pin_threads,
    placement,
    placements,
    rotated,
    spawning_on,
    thread_masks,
)
from benchmarks.harness.proc import runtime_ms
from benchmarks.harness.raw_tcp import RawArenaTcp, serve_tcp
from benchmarks.harness.raw_zmq import RawPeer, payload, serve, start_helper
from benchmarks.peers_fleet import (
    batch_keys,
    fill_holder,
    require_colocated,
    secure_args,
    spec_for,
)
from benchmarks.peers_report import TARGET, print_table, summarize, write_chart
from benchmarks.report import save_report
from kvserver.client import KVClient
from kvserver.daemon import config as daemon_config
from kvserver.daemon.config_checks import PEER_STREAM_WINDOW_MAX, PEER_STREAM_WINDOW_MIN
from kvserver.daemon.config_parse import parse_size
from kvserver.daemon.malloc import MALLOC_ENV, tune_malloc
from kvserver.errors import KVServerError

MiB = 1 << 20
BATCH_BYTES = 32 * MiB
BATCHES = 3
#: the fetching daemons' DRAM (and the floor's receiving mapping).
B_DRAM = 48 * MiB
TIMEOUT_MS = 30_000


# ----------------------------------------------------------------------------- the fleet


#: the fetches timed each round: (name, fetching daemon's key in ``measure``'s daemons).
FETCHES = ("stream", "zmq", "tls", "curve")


#: the sending side's processes (--placement); this process and the fetching daemons receive
SENDING = ("a", "a_sec", "ref_helper", "floor_helper")


def measure(
    workdir: Path,
    part_bytes: int,
    rounds: int,
    env: dict[str, str],
    window: int,
    place: Placement,
) -> dict[str, Any]:
    n = BATCH_BYTES // part_bytes
    pin_threads(os.getpid(), place.receiving)  # this process, its ZMQ I/O threads included
    spec = spec_for(part_bytes)
    secure, curve = secure_args(workdir)
    daemons: dict[str, DaemonProc] = {}
    ref: RawPeer | None = None
    floor: RawArenaTcp | None = None

    def start(name: str, *args: str) -> DaemonProc:
        where = workdir / f"{name}-{part_bytes}"
        with spawning_on(place.sending if name in SENDING else place.receiving):
            daemons[name] = start_daemon(where, *RECORDED_POLICY, *args, env=env)
        return daemons[name]

    try:
        a = start("a", "--dram", f"{BATCHES * 40}MiB")
        a_sec = start("a_sec", "--dram", f"{BATCHES * 40}MiB", *secure)
        b_dram = ("--dram", f"{B_DRAM // MiB}MiB")
        # B fetches over A's peer stream (the default); B_zmq is told not to (-1: ZMQ only);
        # B_tls over A_sec's TLS stream; B_curve over ZMQ with CURVE
        b_window = ("--peer-stream-window", str(window))
        start("stream", *b_dram, *b_window, "--peers", a.zmq_address)
        start("zmq", *b_dram, "--peers", a.zmq_address, "--peer-stream-port", "-1")
        start("tls", *b_dram, *b_window, "--peers", a_sec.zmq_address, *secure)
        start("curve", *b_dram, "--peers", a_sec.zmq_address, "--peer-stream-port", "-1", *secure)
        batches = [batch_keys(part_bytes, i, n) for i in range(BATCHES)]
        for holder, sec in ((a, None), (a_sec, curve)):
            ns_id = fill_holder(holder.zmq_address, spec, batches, part_bytes, sec)
        with spawning_on(place.sending):  # the helpers; RawPeer's own ZMQ context pinned below
            ref = RawPeer(workdir, part_bytes, n, env, TIMEOUT_MS)
            proc, ep = start_helper("serve-tcp", workdir, part_bytes, n, env)
        floor = RawArenaTcp(proc, int(ep.read_text()), part_bytes, n, B_DRAM, TIMEOUT_MS / 1000)
        pin_threads(os.getpid(), place.receiving)
        times: dict[str, list[float]] = {name: [] for name in (*FETCHES, "ref", "get", "floor")}
        # CPU ms per round: A and B around the stream fetch, the reference's two processes
        cpu: dict[str, list[float]] = {k: [] for k in ("a", "b", "ref_sender", "ref_receiver")}
        pids = {"a": a.proc.pid, "b": daemons["stream"].proc.pid,
                "ref_sender": ref.proc.pid, "ref_receiver": os.getpid()}  # fmt: skip
        lookups: list[float] = []  # a lookup of the batch on A, from this process
        clients = {
            name: KVClient(daemons[name].zmq_address, timeout=60,
                           curve=curve if name in ("tls", "curve") else None)
            for name in FETCHES
        }  # fmt: skip
        try:
            with KVClient(a.zmq_address, colocated=False, timeout=60) as remote:
                remote.register_namespace(spec)
                for client in clients.values():
                    client.register_namespace(spec)
                    require_colocated(client)
                    got = client.load(ns_id, batches[0])  # check once: A's bytes, through B
                    assert all(
                        bytes(row[0]) == payload(k, part_bytes)
                        for k, row in zip(batches[0], got, strict=True)
                    ), "B served other bytes"

                short: dict[str, int] = dict.fromkeys(FETCHES, 0)

                def counted(who: tuple[str, str], step: Any, *args: Any) -> float:
                    """``step(*args)``'s result; the CPU of the processes ``who`` meanwhile."""
                    before = [runtime_ms(pids[k]) for k in who]
                    out: float = step(*args)
                    for k, ms in zip(who, before, strict=True):
                        cpu[k].append(runtime_ms(pids[k]) - ms)
                    return out

                def fetch(name: str, keys: list[bytes]) -> float:
                    client = clients[name]
                    start = time.perf_counter()
                    grant = client.prepare_load(ns_id, keys)
                    elapsed = time.perf_counter() - start
                    client.complete_load(grant.lease_id)
                    short[name] += len(grant.keys) < len(keys)  # a fetch that placed less
                    return elapsed

                for r in range(1, rounds + 1):
                    keys = batches[r % BATCHES]
                    times["ref"].append(counted(("ref_sender", "ref_receiver"), ref.round))
                    times["floor"].append(floor.round())
                    start_get = time.perf_counter()
                    remote.get(ns_id, keys)  # context: one remote get straight from A
                    times["get"].append(time.perf_counter() - start_get)
                    start_lookup = time.perf_counter()  # what a lookup before a fetch cost
                    assert remote.lookup(ns_id, keys).hit_chunks == n
                    lookups.append(time.perf_counter() - start_lookup)
                    for i in range(len(FETCHES)):  # rotate who goes first
                        name = FETCHES[(i + r) % len(FETCHES)]
                        if name == "stream":
                            times[name].append(counted(("a", "b"), fetch, name, keys))
                        else:
                            times[name].append(fetch(name, keys))
                stats = {name: c.stats()["peer"] for name, c in clients.items()}
                # every thread there is now (the daemons' fetching threads started): where it
                # may run, checked against the placement and reported
                procs = {"bench": os.getpid(), "ref_helper": ref.proc.pid,
                         "floor_helper": proc.pid,
                         **{name: d.proc.pid for name, d in daemons.items()}}  # fmt: skip
                masks = {name: thread_masks(pid) for name, pid in procs.items()}
                check(masks, {name: place.sending if name in SENDING else place.receiving
                              for name in procs})  # fmt: skip
                # A's get replies answered 'capacity' (its zmq_send_max_unsent): B_zmq's
                # windows over its cap, asked again (the stream fetches are not counted here)
                zmq_refused = int(remote.stats()["zmq_sends"]["refused"])
        finally:
            for client in clients.values():
                client.close()
        per_load = -(-n // max(1, window // part_bytes))  # the windows of one fetch
        for name in ("stream", "tls"):
            assert stats[name]["stream_fetches"] == stats[name]["fetches"] > 0, stats[name]
            assert stats[name]["fetches"] == (rounds + 1) * per_load, (per_load, stats[name])
        # every timed load was granted every key: a fetch that evicted its own earlier windows
        # (and so granted a shorter run) would have been timed doing less than the reference
        assert not any(short.values()), f"loads granted fewer keys than asked: {short}"
        for name in ("zmq", "curve"):
            assert stats[name]["stream_fetches"] == 0, stats[name]
            assert stats[name]["fetched_chunks"] >= rounds * n, stats[name]
    finally:
        if ref is not None:
            ref.close()
        if floor is not None:
            floor.close()
        for d in reversed(daemons.values()):
            d.terminate()
    nbytes = n * part_bytes
    bw = {name: [nbytes / s / MiB for s in ts] for name, ts in times.items()}
    med = {name: statistics.median(v) for name, v in bw.items()}
    ref_med = med["ref"]

    def paired(name: str) -> list[float]:
        return [f / r for f, r in zip(bw[name], bw["ref"], strict=True)]

    return {
        "name": f"peer fetch, {part_bytes // 1024} KiB parts x {n}",
        "part_bytes": part_bytes,
        "chunks_per_fetch": n,
        "rounds": rounds,
        "placement": place.describe(),
        "thread_masks": masks,  # per process: Cpus_allowed_list -> threads with it
        "stream_window_bytes": window,
        "stream_windows_per_fetch": per_load,
        "value_MBps": med["stream"],
        "reference_MBps": ref_med,
        "ratio": med["stream"] / ref_med,
        "round_ratios": paired("stream"),
        "paired_ratio_median": statistics.median(paired("stream")),
        "zmq_MBps": med["zmq"],
        "zmq_ratio": med["zmq"] / ref_med,
        "zmq_round_ratios": paired("zmq"),
        "zmq_paired_ratio_median": statistics.median(paired("zmq")),
        "zmq_refused_windows": zmq_refused,
        "tls_MBps": med["tls"],
        "tls_ratio": med["tls"] / ref_med,
        "tls_paired_ratio_median": statistics.median(paired("tls")),
        "curve_MBps": med["curve"],
        "curve_ratio": med["curve"] / ref_med,
        "curve_paired_ratio_median": statistics.median(paired("curve")),
        "tls_over_curve": med["tls"] / med["curve"],
        "floor_MBps": med["floor"],
        "floor_ratio": med["floor"] / ref_med,
        "stream_over_floor": med["stream"] / med["floor"],
        "remote_get_MBps": med["get"],
        "remote_get_ratio": med["get"] / ref_med,
        "fetch_ms_median": statistics.median(times["stream"]) * 1e3,
        "zmq_fetch_ms_median": statistics.median(times["zmq"]) * 1e3,
        "tls_fetch_ms_median": statistics.median(times["tls"]) * 1e3,
        "curve_fetch_ms_median": statistics.median(times["curve"]) * 1e3,
        "reference_ms_median": statistics.median(times["ref"]) * 1e3,
        # CPU per round (ms, medians): A and B during the stream fetch (B's to the grant; A's
        # release after its send may fall outside), the reference's sender and receiver
        "cpu_ms_median": {k: statistics.median(v) for k, v in cpu.items()},
        # --peers: B asks A for the bytes without a lookup first (PeerTier.promote); a
        # lookup of A, as each load made before, cost about lookup_ms_median more per load
        "lookup_ms_median": statistics.median(lookups) * 1e3,
        "lookup_share_of_fetch": statistics.median(lookups)
        / (statistics.median(times["stream"]) + statistics.median(lookups)),
        "directory_lookups_per_load": stats["stream"]["directory_lookups"] / (rounds + 1),
        "directory_skipped_per_load": stats["stream"].get("directory_skipped", 0) / (rounds + 1),
        "peer_stats": stats,
        "short_loads": short,
    }


def run(
    workdir: Path,
    sizes: list[int],
    rounds: int,
    env: dict[str, str],
    window: int,
    place: Placement,
) -> dict[str, Any]:
    load_before = os.getloadavg()
    results = [measure(workdir, size, rounds, env, window, place) for size in sizes]
    return {
        "benchmark": "peers",
        "target": TARGET,
        "placement": place.name,
        "stream_window_bytes": window,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "reference": "raw ZMQ DEALER/ROUTER between two processes, same frames (copy=False)",
        "results": results,
    }


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(t) for t in text.split(",")]
    except KVServerError as exc:  # parse_size's InvalidArgument
        raise argparse.ArgumentTypeError(str(exc)) from None


def _window(text: str) -> int:
    (size,) = _sizes(text)
    lo, hi = PEER_STREAM_WINDOW_MIN, PEER_STREAM_WINDOW_MAX
    if not lo <= size <= hi:
        raise argparse.ArgumentTypeError("a stream window is between 1MiB and 1GiB")
    return size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1], int(argv[2]), int(argv[3]))
    if argv[:1] == ["serve-tcp"]:
        return serve_tcp(argv[1], int(argv[2]), int(argv[3]), BATCHES)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one chunk size, 6 rounds")
    parser.add_argument("--parts", type=_sizes, metavar="SIZES",
                        help="part sizes, comma-separated (default 256KiB,1MiB,4MiB; "
                             "--quick: 1MiB)")  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="timed rounds per part size (default 25; --quick: 6)",
    )
    parser.add_argument("--stream-window", type=_window, metavar="SIZE",
                        default=daemon_config.DEFAULT_PEER_STREAM_WINDOW,
                        help="B's and B_tls's --peer-stream-window, e.g. 8MiB (default the "
                             "daemon's, 32MiB; 1MiB to 1GiB)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="repeat the whole run N times (fresh daemons each); the summary "
                             "is the median over runs")  # fmt: skip
    parser.add_argument("--placement", choices=("free", "same", "split", "all"), default="free",
                        help="CPUs of the receiving side (this process, the fetching daemons) "
                             "and the sending side (A, A_sec, the reference's and the floor's "
                             "helpers), the same for every fetch and the reference: "
                             "free (default) where the scheduler puts them, same one CPU, "
                             "split one CPU each; all: each of the three every run, "
                             "rotating")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON here")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave every process on glibc's allocator defaults")  # fmt: skip
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if not args.default_malloc:
        env.update(MALLOC_ENV)
        tune_malloc()  # this process receives the reference's frames: tuned as B is
    workdir = Path(tempfile.mkdtemp(prefix="kvserver-bench-peers-", dir="/tmp"))
    try:
        sizes = args.parts or ([1 * MiB] if args.quick else [256 << 10, 1 * MiB, 4 * MiB])
        rounds = args.rounds or (6 if args.quick else 25)
        cpus = os.sched_getaffinity(0)
        names = placements(args.placement)
        runs = [
            run(workdir, sizes, rounds, env, args.stream_window, placement(name, cpus))
            for i in range(args.runs)
            for name in rotated(names, i)
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "benchmark": "peers",
        "target": TARGET,
        "stream_window_bytes": args.stream_window,
        "reference": runs[0]["reference"],
        "placement": args.placement,
        "runs": runs,
        "summary": summarize(runs) if len(names) == 1 else [],
        "placements": {
            name: summarize([r for r in runs if r["placement"] == name]) for name in names
        },
    }
    print_table(report)
    if args.json is not None:
        save_report(args.json, report, lambda png: write_chart(report, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
