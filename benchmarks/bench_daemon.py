"""``kvserver bench``: the daemon's data-path and query benchmarks (targets: docs/benchmarks.md).

Runs in the bench process, which is always a *client*: it starts its own daemon (``kvserver
start`` as a subprocess on ephemeral loopback ports, stopped with SIGTERM at the end) unless
``--zmq`` / ``--server`` name a running one. Every figure is a ratio to a reference measured in
the same run, interleaved repeat by repeat with the measurement so that noise on a shared
machine hits both alike (medians are reported):

1. co-located store + load (shared memory) vs single-thread memcpy (``daemon_refs``);
2. remote store + load (``put``/``get`` over TCP loopback) vs raw ZMQ PUSH/PULL between two
   processes with the same frames and round trips (``daemon_refs.ZmqPeer``), and vs Redis
   SET/GET of the same parts, pipelined and one command at a time (``daemon_redis.RedisRef``;
   skipped, saying why, when ``redis-server`` or the ``redis`` package is missing);
3. gRPC ``Lookup`` latency of a 32k-token prompt (2,048 blocks of 16), by keys (target p99 <=
   2 ms) and, for information, by token ids (``daemon_lookup``). Latency rows use the 2 ms
   target as reference.

Bandwidth = bytes moved (stored + loaded) / seconds. Before timing, the arena is cycled once by
each path so that its pages are mapped in both processes (steady state, as in a long-running
daemon; the memcpy reference buffers are likewise touched in advance). Not thread-safe.
Rows, targets, the table, the JSON document and the chart are in ``daemon_report``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.daemon_lookup import bench_lookup
from benchmarks.daemon_redis import MODES as REDIS_MODES
from benchmarks.daemon_report import (
    Result,
    document,
    gbps,
    print_table,
    redis_reference,
    remote_rows,
    write_chart,
)
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import UnknownKey

if TYPE_CHECKING:
    from benchmarks.daemon_redis import RedisRef
    from benchmarks.daemon_refs import Target, ZmqPeer
    from kvserver.client import KVClient
    from kvserver.namespace import NamespaceSpec

DEFAULT_SIZES = "256KiB,2MiB,8MiB"
DEFAULT_DRAM = "1GiB"
#: the daemon's own default policy (``kvserver start``'s): the bench runs what deployments run
#: (until session 14 it ran ``prefix``, the policy of the figures recorded before session 9)
DEFAULT_POLICY = DaemonConfig().policy
LOOKUP_BLOCK_SIZE = 16
CLIENT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class BenchConfig:
    sizes: tuple[int, ...]
    repeats: int
    batch_bytes: int
    lookup_iters: int
    token_iters: int
    dram: str
    progress: bool = True
    #: give every process the same glibc allocator settings (daemon_refs.MALLOC_ENV).
    tune_malloc: bool = True
    #: the ``redis-server`` executable of the Redis reference; None: no Redis reference.
    redis_server: str | None = "redis-server"
    #: DRAM eviction policy of our own daemon: the daemon's default (what deployments run)
    policy: str = DEFAULT_POLICY
    #: the remote client's put and get over the daemon's stream port (``KVClient(stream=)``);
    #: on by default, as in ``KVClient``: the rows measure what a user's client does.
    stream: bool = True

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("--sizes needs at least one positive size")
        if self.repeats < 1 or self.lookup_iters < 1 or self.token_iters < 1:
            raise ValueError("--repeats and --lookup-iters must be >= 1")

    def count(self, size: int) -> int:
        """Chunks per batch for part size ``size`` (at least one)."""
        return max(1, self.batch_bytes // size)


# --------------------------------------------------------------------------- helpers


def _spec(size: int, tag: str) -> NamespaceSpec:
    from kvserver.namespace import NamespaceSpec

    return NamespaceSpec(
        model=f"kvserver-bench/{tag}-{size}", dtype="uint8", num_layers=1, num_kv_heads=1,
        head_dim=1, block_size=LOOKUP_BLOCK_SIZE, part_bytes_override=size,
    )  # fmt: skip


def _keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _split(buf: memoryview, size: int, n: int) -> list[memoryview]:
    return [buf[i * size : (i + 1) * size] for i in range(n)]


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Progress:
    """A tqdm bar over every timed and warm-up round of the run."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, disable=not enabled, unit="round", file=sys.stderr)

    def phase(self, text: str) -> None:
        self._bar.set_description(text)

    def step(self, n: int = 1) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


# --------------------------------------------------------------------------- bandwidth


def _colocated_round(
    kv: KVClient, ns_id: str, src: list[memoryview], dst: list[memoryview]
) -> float:
    """prepare_store (one message) → write each part → complete_store; then the load side.
    The completions are sent without waiting (``*_nowait``): the load's is collected by the
    next round's first call, so a round pays for its predecessor's.

    Returns the seconds taken (key generation excluded)."""
    keys = _keys(len(src))
    start = time.perf_counter()
    store = kv.prepare_store(ns_id, keys)
    if store is None or store.keys != keys:
        raise RuntimeError("prepare_store did not grant every key (DRAM too small?)")
    for ext, part in zip(store.locations, src, strict=True):
        kv.write(ext[0], part)
    kv.complete_store_nowait(store.lease_id)
    load = kv.prepare_load(ns_id, keys)
    for ext, out in zip(load.locations, dst, strict=True):
        kv.readinto(ext[0], out)
    kv.complete_load_nowait(load.lease_id)
    return time.perf_counter() - start


def _remote_round(
    kv: KVClient, ns_id: str, src: list[memoryview]
) -> tuple[float, list[list[memoryview]]]:
    """put (one message) then get (one message); returns seconds taken and the loaded parts."""
    keys = _keys(len(src))
    start = time.perf_counter()
    put = kv.put(ns_id, keys, src)
    if len(put.stored) != len(keys):
        raise RuntimeError("put did not store every key (DRAM too small?)")
    try:
        parts = kv.get(ns_id, keys)
    except UnknownKey as exc:
        from kvserver.client.ops import put_windows

        raise RuntimeError(_lost_window(exc, len(put_windows(keys, src)))) from exc
    return time.perf_counter() - start, parts


def _lost_window(exc: UnknownKey, windows: int) -> str:
    """Why a remote round's get missed a key its put had just stored, and what to do."""
    from kvserver.client.ops import PUT_WINDOW_BYTES

    if windows < 2:
        return f"the get missed a key its put had just stored: {exc}"
    return (
        f"the get missed a key its put had just stored ({exc}). The put went over ZMQ "
        f"(--no-stream) as {windows} windows of at most {_fmt_size(PUT_WINDOW_BYTES)} "
        "(a store request each) and the daemon's eviction policy took an earlier window's "
        "chunks to make room for a later one's. ARC (--policy arc) does so by design once "
        "DRAM is full: the put's chunks are new (its T1, seen once), every earlier batch was "
        "loaded (T2, seen twice), and with no ghost hit T1's target stays 0, so T1 is evicted "
        "first. Run --policy chain (the daemon's default), lru or prefix, --batch "
        f"{_fmt_size(PUT_WINDOW_BYTES)} (one window per put), or the stream port (no "
        "--no-stream: a put is one request)"
    )


def bench_bandwidth(
    cfg: BenchConfig,
    target: Target,
    arena_size: int,
    env: dict[str, str],
    progress: _Progress,
    redis: RedisRef | None = None,
) -> list[Result]:
    from benchmarks.daemon_refs import ZmqPeer, page_aligned
    from kvserver.client import KVClient

    max_bytes = max(cfg.count(s) * s for s in cfg.sizes)
    src_buf = page_aligned(max_bytes, random.Random(0).randbytes(max_bytes))
    dst_buf = page_aligned(max_bytes)
    stage = page_aligned(max_bytes)
    results: list[Result] = []
    with ExitStack() as stack:
        local = stack.enter_context(KVClient(target.zmq, colocated=True, timeout=CLIENT_TIMEOUT_S))
        remote = stack.enter_context(
            KVClient(target.zmq, colocated=False, timeout=CLIENT_TIMEOUT_S, stream=cfg.stream)
        )
        peer = ZmqPeer()
        stack.callback(peer.close)
        peer.start(env)
        ns = {s: local.register_namespace(_spec(s, "bw")).ns_id for s in cfg.sizes}
        for s in cfg.sizes:
            remote.register_namespace(_spec(s, "bw"))

        # Warm-up: cycle the whole arena through each path in turn, so that every page is
        # mapped in this process (co-located) and in the daemon (remote).
        big = max(cfg.sizes)
        n_big = cfg.count(big)
        src, dst = _split(src_buf, big, n_big), _split(dst_buf, big, n_big)
        progress.phase("warm-up: cycling the arena")
        rounds = _warmup_rounds(arena_size, n_big * big)
        for _ in range(rounds):
            _colocated_round(local, ns[big], src, dst)
            progress.step()
        for _ in range(rounds):
            _remote_round(remote, ns[big], src)
            progress.step()

        for size in cfg.sizes:
            n = cfg.count(size)
            src, dst = _split(src_buf, size, n), _split(dst_buf, size, n)
            label = f"{_fmt_size(size)} x{n} ({_fmt_size(n * size)} batch)"
            progress.phase(f"co-located {_fmt_size(size)}")
            ours, ref = _bench_colocated(cfg.repeats, local, ns[size], src, dst, stage, progress)
            if dst_buf[: n * size] != src_buf[: n * size]:
                raise RuntimeError("co-located load returned different bytes")
            results.append(Result.of(f"co-located store+load {label} vs memcpy", ours, "GB/s", ref))
            progress.phase(f"remote {_fmt_size(size)}")
            times = _bench_remote(cfg.repeats, remote, ns[size], src, peer, redis, progress)
            results += remote_rows(label, 2 * n * size, *times)
    return results


def _bench_colocated(
    repeats: int,
    kv: KVClient,
    ns_id: str,
    src: list[memoryview],
    dst: list[memoryview],
    stage: memoryview,
    progress: _Progress,
) -> tuple[float, float]:
    """GB/s of (ours, memcpy), rounds interleaved; ``dst`` holds what our last load read."""
    from benchmarks.daemon_refs import memcpy_round

    moved = 2 * sum(part.nbytes for part in src)
    ours_s: list[float] = []
    ref_s: list[float] = []
    _colocated_round(kv, ns_id, src, dst)  # untimed first round
    for _ in range(repeats):
        start = time.perf_counter()
        memcpy_round(src, stage, dst)
        ref_s.append(time.perf_counter() - start)
        for out in dst:  # what memcpy left there must not hide a broken load
            out[:1] = b"\0"
        ours_s.append(_colocated_round(kv, ns_id, src, dst))
        progress.step()
    return gbps(moved, ours_s), gbps(moved, ref_s)


def _bench_remote(
    repeats: int,
    kv: KVClient,
    ns_id: str,
    src: list[memoryview],
    peer: ZmqPeer,
    redis: RedisRef | None,
    progress: _Progress,
) -> tuple[list[float], list[float], dict[str, list[float]] | None]:
    """Seconds per round of (ours, raw ZMQ, Redis per client mode or None), rounds
    interleaved; checks the bytes of one get and of one Redis round per mode."""
    ours_s: list[float] = []
    ref_s: list[float] = []
    redis_rounds: dict[str, Callable[[], tuple[float, list[bytes]]]] = {}
    if redis is not None:
        redis_rounds = {
            mode: functools.partial(redis.store_load, src, mode) for mode in REDIS_MODES
        }
    redis_s: dict[str, list[float]] = {mode: [] for mode in redis_rounds}
    _check_remote(_remote_round(kv, ns_id, src)[1], src)  # untimed first rounds
    peer.store_load(src)
    for mode, redis_round in redis_rounds.items():
        if redis_round()[1] != [bytes(part) for part in src]:
            raise RuntimeError(f"Redis GET ({mode}) returned different bytes")
    for _ in range(repeats):
        start = time.perf_counter()
        peer.store_load(src)
        ref_s.append(time.perf_counter() - start)
        ours_s.append(_remote_round(kv, ns_id, src)[0])
        for mode, redis_round in redis_rounds.items():
            redis_s[mode].append(redis_round()[0])
        progress.step()
    return ours_s, ref_s, redis_s if redis is not None else None


def _warmup_rounds(arena_size: int, batch: int) -> int:
    return -(-arena_size // batch) + 1


def _check_remote(parts: list[list[memoryview]], src: list[memoryview]) -> None:
    if len(parts) != len(src) or any(p[0] != s for p, s in zip(parts, src, strict=True)):
        raise RuntimeError("remote get returned different bytes")


# --------------------------------------------------------------------------- run and report


def run(cfg: BenchConfig, target: Target | None) -> tuple[list[Result], dict[str, Any]]:
    """Run every benchmark against ``target`` (or a daemon of our own); returns the rows and
    the ``redis`` section of the report (what was compared, or why Redis was skipped)."""
    from benchmarks.daemon_refs import MALLOC_ENV, own_daemon, tune_malloc

    # --default-malloc: glibc's defaults everywhere, the daemon included (it tunes itself
    # unless told not to)
    env: dict[str, str] = {"KVSERVER_TUNE_MALLOC": "0"}
    if cfg.tune_malloc and tune_malloc():
        env = MALLOC_ENV
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-")))
        daemon = "a running daemon (allocator settings its own)"
        if target is None:
            target = stack.enter_context(own_daemon(cfg.dram, workdir, env, cfg.policy))
            daemon = "its own daemon"
        from kvserver.client import KVClient

        with KVClient(target.zmq, timeout=CLIENT_TIMEOUT_S) as kv:
            arena_size = int(kv.hello()["arena_size"])
        sizes = ", ".join(_fmt_size(s) for s in cfg.sizes)
        print(
            f"kvserver bench against {daemon}, DRAM {_fmt_size(arena_size)}; parts {sizes}; "
            f"{_fmt_size(cfg.batch_bytes)} per batch, median of {cfg.repeats} rounds "
            f"interleaved with the reference; glibc allocator: "
            f"{'same tuned settings in every process' if env else 'defaults'}",
            flush=True,
        )
        redis, skipped = _start_redis(cfg, workdir, stack)
        if redis is not None:
            print(
                f"Redis reference: redis-server {redis.server_version}, {redis.client}", flush=True
            )
        else:
            print(f"Redis reference skipped: {skipped}", flush=True)
        big = max(cfg.sizes)
        total = (
            2 * _warmup_rounds(arena_size, cfg.count(big) * big)
            + 2 * len(cfg.sizes) * cfg.repeats
            + 2 * cfg.lookup_iters
            + 2 * cfg.token_iters
        )
        progress = _Progress(total, cfg.progress)
        stack.callback(progress.close)
        results = bench_bandwidth(cfg, target, arena_size, env, progress, redis)
        results += bench_lookup(
            target, _spec(1024, "lookup"), cfg.lookup_iters, cfg.token_iters, progress,
            CLIENT_TIMEOUT_S,
        )  # fmt: skip
    if redis is None:
        return results, redis_reference(results, skipped=skipped)
    return results, redis_reference(
        results, skipped=None, server=redis.server_version, client=redis.client
    )


def _start_redis(
    cfg: BenchConfig, workdir: Path, stack: ExitStack
) -> tuple[RedisRef | None, str | None]:
    """The started Redis reference (closed with ``stack``), or None and why not.

    A missing ``redis-server`` or ``redis`` package skips the reference; a server that is
    present but will not start raises RuntimeError.
    """
    from benchmarks.daemon_redis import RedisRef, redis_unavailable

    if cfg.redis_server is None:
        return None, "not requested (--no-redis)"
    why = redis_unavailable(cfg.redis_server)
    if why is not None:
        return None, why
    redis = RedisRef(workdir, max(cfg.count(s) * s for s in cfg.sizes), server=cfg.redis_server)
    stack.callback(redis.close)
    redis.start()
    return redis, None


# --------------------------------------------------------------------------- command line


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvserver bench`` (the ``kvserver.commands`` entry point ``bench``)."""
    p = sub.add_parser(
        "bench",
        help="benchmark the data paths and Lookup latency against same-run references",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start a daemon of its own (kvserver start on ephemeral loopback ports, stopped at\n"
            "the end), or use the running one that --zmq and --server name, and measure:\n"
            "  1. co-located store + load (shared memory) vs single-thread memcpy;\n"
            "  2. remote put + get (TCP loopback) vs raw ZMQ PUSH/PULL with the same frames,\n"
            "     and vs Redis SET/GET (skipped, saying why, without redis-server);\n"
            "  3. gRPC Lookup latency of a 32k-token prompt vs the 2 ms p99 target.\n"
            "Every figure is a ratio to its reference measured in the same run, interleaved\n"
            "round by round so that noise on a shared machine hits both alike (medians)."
        ),
        epilog=(
            "examples:\n"
            "  kvserver bench --quick --no-redis        # the short run, without Redis\n"
            "  kvserver bench --json benchmarks/results/daemon.json   # and daemon.png\n\n"
            "exit status: 0 measured (a target missed is a NO row, not an error), 1 the daemon\n"
            "failed or could not be reached, 2 bad arguments. Figures: docs/benchmarks.md"
        ),
    )
    add = p.add_argument
    add("--quick", action="store_true", help="fewer repeats (every size still runs)")
    add("--json", type=Path, metavar="FILE", help="write the results here, a .png chart beside")
    add("--sizes", default=DEFAULT_SIZES, help=f"part sizes (default {DEFAULT_SIZES})")
    add("--batch", default="64MiB", help="bytes per prepare_store / put batch (default 64MiB)")
    add("--repeats", type=int, help="timed rounds per size and path (default 25, quick 4)")
    add("--lookup-iters", type=int, help="Lookups by keys (default 3000, quick 300)")
    add("--dram", default=DEFAULT_DRAM, help=f"DRAM of our daemon (default {DEFAULT_DRAM})")
    add(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"DRAM eviction policy of our daemon (default {DEFAULT_POLICY}, the daemon's; "
        "arc with --no-stream cannot run a put of several windows, see --batch)",
    )
    add(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="the remote rows over ZMQ (KVClient(stream=False)), not the daemon's stream port",
    )
    add("--zmq", metavar="ENDPOINT", help="bench a running daemon (evicts what it caches)")
    add("--server", metavar="HOST:PORT", help="that daemon's gRPC address (with --zmq)")
    add("--no-progress", action="store_true", help="no progress bar")
    add(
        "--default-malloc",
        action="store_true",
        help="keep glibc's allocator defaults in every process (see benchmarks/daemon_refs.py)",
    )
    add("--no-redis", action="store_true", help="skip the Redis SET/GET reference")
    add(
        "--redis-server",
        default="redis-server",
        metavar="PATH",
        help="redis-server executable of the Redis reference (default: redis-server on PATH; "
        "skipped, saying why, if missing)",
    )
    p.set_defaults(func=_cmd_bench)


def _size(flag: str, text: str) -> int:
    """``text`` in bytes; a ValueError naming ``flag`` when it is no size."""
    from kvserver.daemon.config_parse import parse_size
    from kvserver.errors import KVServerError

    try:
        return parse_size(text)
    except (KVServerError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvserver.grpc_engine import use_polling_engine

    use_polling_engine()  # the client as the daemon: before grpc is imported
    from kvserver.errors import KVServerError

    try:
        if (args.zmq is None) != (args.server is None):
            raise ValueError("--zmq and --server go together")
        _size("--dram", args.dram)  # refused here (was: the daemon's refusal, exit status 1)
        lookup_iters = args.lookup_iters or (300 if args.quick else 3000)
        cfg = BenchConfig(
            sizes=tuple(_size("--sizes", s) for s in args.sizes.split(",") if s.strip()),
            repeats=args.repeats or (4 if args.quick else 25),
            batch_bytes=_size("--batch", args.batch),
            lookup_iters=lookup_iters,
            token_iters=max(1, lookup_iters // 10),
            dram=args.dram,
            progress=not args.no_progress,
            tune_malloc=not args.default_malloc,
            redis_server=None if args.no_redis else args.redis_server,
            policy=args.policy,
            stream=args.stream,
        )
    except (KVServerError, ValueError) as exc:
        print(f"kvserver bench: error: {exc}", file=sys.stderr)
        return 2
    from benchmarks.daemon_refs import Target, unanswered
    from kvserver.cli_ops import DEFAULT_TIMEOUT_S

    target = Target(args.zmq, args.server) if args.zmq else None
    why = unanswered(target, DEFAULT_TIMEOUT_S) if target is not None else None
    if why is not None:  # said at once (was: after the first call's CLIENT_TIMEOUT_S)
        print(f"kvserver bench: error: {why}", file=sys.stderr)
        return 1
    try:
        results, redis = run(cfg, target)
    except (KVServerError, RuntimeError, TimeoutError) as exc:
        print(f"kvserver bench: error: {exc}", file=sys.stderr)
        return 1
    print_table(results, redis)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document(results, redis), indent=2) + "\n")
        chart = args.json.with_suffix(".png")
        write_chart(results, chart)
        print(f"wrote {args.json} and {chart}")
    return 0


if __name__ == "__main__":
    from kvserver.cli import run_alone

    sys.exit(run_alone(add_bench, "bench"))
