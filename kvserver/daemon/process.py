"""The daemon process: one uvloop event loop serving ZMQ and gRPC over one KVService.

This is the only daemon module that knows it is a process (event loop, signals, exit codes,
the C allocator).

Start-up: apply the glibc allocator settings (``malloc.py``; before any thread exists, unless
``tune_malloc`` is off) → check what would fail later (``preflight.py``: the host, the
ports, the CURVE key, the ready file) → build the service (creates the shared-memory arena)
→ open the SSD tier when configured (lock its directory, rebuild its index from the chunk
headers, re-register the saved namespaces; a directory that cannot be used leaves the tier
``unavailable`` and retried, the daemon serves DRAM; a ``--ssd`` over the filesystem's room is
warned about) →
below it the network tier over a fixed peer list when ``--peers`` is set → start the ZMQ
front end → open the peer stream port (``stream_server.py``;
TLS with the gRPC certificate when ``tls_cert_file`` is set; none when ``peer_stream_port``
is -1, or CURVE is configured without a certificate; announced in ``hello``) → start the
gRPC front end → leave the token (a
random one unless configured, or none with ``no_auth``) for this user's clients
(``kvserver/token_file.py``) → start the lease reaper → serve Prometheus ``/metrics``
(``metrics.py``; a port that cannot be bound is logged, the daemon serves without) → join the
fleet when ``--cluster`` is set
(``kvserver/cluster/node.py``: register, resync the fleet index; an unreachable Redis does not
stop the daemon) and put the network tier over the fleet index at the bottom of the stack
(``kvserver/daemon/peers/``) → collect and freeze what start-up left (``settle_gc``) → log
where it listens → write the ready file (last, so that whoever waits for it finds that line).
A stop signal during start-up (recorded from the process's start, ``signals.py``) stops it at
its next step (the pre-fault included), undoing what was done: exit 0, no arena left.

Shutdown on SIGTERM/SIGINT/SIGHUP, in order: leave the fleet (record and index entries
removed) → stop serving metrics → stop accepting (gRPC server stops taking new RPCs, ZMQ
sockets stop reading, the peer stream's connections close and their pins end) → give
in-flight RPCs a short grace → close the tiers below DRAM,
slowest first (the SSD tier drains its in-flight writes for at most ``ssd_drain_timeout_s``,
10 s by default, and closes its files; disk jobs still running then are abandoned, and the
process exits without waiting for them: ``os._exit``) → roll back
in-flight reservations and release pins → stop event streams → remove the shared-memory
arena and the token files → exit 0. A second stop signal during that shutdown (a second
Ctrl-C, a hung disk's drain taking its 10 s) exits at once, as a SIGKILL would (the SSD tier
is crash-safe: the next start rebuilds it; the fleet record expires), but first removes the
arena, its local-channel socket, the token files and the ready file: exit 128 + the signal's
number; a repeat within a second of the first signal is the same request, not a second one
(``kvserver/stop_signals.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from kvserver.arena import check_room, not_in_memory, reap_stale_arenas
from kvserver.cluster.node import ClusterNode
from kvserver.cluster.schema import check_host_id
from kvserver.crypto import TlsServer
from kvserver.daemon.auth import ADMIN, Authenticator
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.grpc_server import GrpcFrontend
from kvserver.daemon.listening import listening_line
from kvserver.daemon.malloc import tune_malloc
from kvserver.daemon.metrics import DaemonCollector
from kvserver.daemon.peer_setup import fleet_peer_tier, static_peer_tier
from kvserver.daemon.preflight import preflight
from kvserver.daemon.service import KVService
from kvserver.daemon.signals import forward, pause_point, recording
from kvserver.daemon.stream_server import StreamServer
from kvserver.daemon.tenants import tenant_tokens
from kvserver.daemon.tiering import SsdTier
from kvserver.daemon.zmq_server import DataFrontend
from kvserver.errors import KVServerError
from kvserver.files import write_atomic
from kvserver.prometheus import serve_metrics
from kvserver.ssd.config import disk_room
from kvserver.stop_signals import Leaving, StopSignals
from kvserver.token_file import (
    TokenFiles,
    reap_stale_token_files,
    remove_token_files,
    server_token,
    token_dir,
    token_path,
    write_token_files,
)

logger = logging.getLogger("kvserver.daemon")

SHUTDOWN_GRACE_S = 2.0
SWITCH_INTERVAL_S = 0.0005
#: new container objects between two young collections once started (CPython's default:
#: 700). A gRPC Lookup allocates ~20, so at 700 one call in ~80 paid a collection
#: (docs/benchmarks.md, "Lookup latency, issue 15").
GC_YOUNG_THRESHOLD = 10_000
#: what the warning of a forced exit (a later stop signal during the shutdown) says
FORCED_EXIT_NOTE = (
    "(SSD writes in flight are not on SSD; the next start rebuilds the tier); the arena and "
    "the token files are removed"
)


class _StoppedStarting(Exception):
    """``stop`` was set during start-up; the argument names the step that saw it."""


async def serve(
    config: DaemonConfig,
    stop: asyncio.Event | None = None,
    *,
    malloc_tuned: bool = False,
    serving: Callable[[], None] | None = None,
    leaving: Callable[[list[str]], None] | None = None,
) -> int:
    """Run the daemon until ``stop`` is set (or SIGTERM/SIGINT when run by :func:`main`);
    ``malloc_tuned`` (whether :func:`main` applied the allocator settings) goes into the ready
    file; ``serving()`` is called once started, before the start-up line; ``leaving(paths)``
    when the shutdown begins, with the files it will remove (arena, local-channel socket, token
    and ready files: what a hurried exit removes, ``kvserver/stop_signals.py``). A ``stop``
    set during start-up stops it at its next step, what was done undone. Returns the SSD tier's
    disk jobs left running past its drain timeout (10 s) at shutdown (``SsdTier.close``; 0
    normally)."""
    stop = stop or asyncio.Event()
    try:
        return await _serve(config, stop, malloc_tuned, serving, leaving)
    except _StoppedStarting as exc:
        logger.info("stopped during start-up (a stop signal before step %s)", exc)
        return 0


async def _serve(
    config: DaemonConfig,
    stop: asyncio.Event,
    malloc_tuned: bool,
    serving: Callable[[], None] | None,
    leaving: Callable[[list[str]], None] | None,
) -> int:
    def step(name: str) -> None:  # start-up goes on unless stopped
        pause_point(name)
        if stop.is_set():
            raise _StoppedStarting(name)

    step("config")
    # safe by default (docs/security.md): a random token unless one is configured or no_auth;
    # config keeps the configured one (what this daemon sends its peers: "" = their own files)
    token = server_token(config.auth_token, config.no_auth)
    auth = Authenticator.single(token)
    if config.tenants:  # restricted tokens beside the daemon's own (docs/security.md, "Tenants")
        auth = Authenticator([(token, ADMIN), *tenant_tokens(config.tenants)])
        logger.info("tenants: %s", ", ".join(t.name for t in config.tenants))
        if config.pub_port >= 0 and not config.curve_clients_dir:
            logger.warning(
                "the KV-event PUB carries every tenant's events and cannot check tokens: "
                "give it to trusted consumers only (curve_clients_dir) or disable it "
                "(pub_port = -1)"
            )
    # a TLS daemon's stream is TLS, never plain; CURVE without TLS opens none (docs/cluster.md).
    # Made before the arena exists: a TLS file that cannot be used leaves nothing behind.
    stream_tls = None
    if config.tls_cert_file:
        tls_files = TlsServer(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
        stream_tls = tls_files.ssl_context()
    preflight(config)  # before the arena: a port in use, a missing key file is said at once
    token_files: TokenFiles | None = None
    for path in reap_stale_arenas(config.shm_dir):
        what = "local-channel socket" if path.endswith(".sock") else "arena"
        logger.warning("removed the %s %s left by a daemon that is no longer running", what, path)
    stale_tokens = reap_stale_token_files(config.shm_dir)
    if stale_tokens:
        logger.info("removed %d token files left by servers that are no longer running in %s",
                    len(stale_tokens), token_dir(config.shm_dir))  # fmt: skip
    engine_config = config.engine_config()
    check_room(engine_config.num_pages * engine_config.page_size, config.shm_dir)
    if disk := not_in_memory(config.shm_dir):  # a warning: a test may want it there
        logger.warning("%s", disk)
    logger.info(
        "pre-faulting the DRAM arena: %d MiB in %s (the tier's memory is committed now)",
        engine_config.num_pages * engine_config.page_size >> 20,
        config.shm_dir,
    )
    with _Progress("pre-faulting the DRAM arena") as progress:

        def prefaulted(done: int, total: int) -> None:  # a stop ends the pre-fault here
            progress(done, total)
            step("prefault")

        service = KVService(
            engine_config, event_capacity=config.event_capacity, prefault_progress=prefaulted
        )
    zmq_front = DataFrontend(service, config, auth)
    service.zmq_sends = zmq_front.sender
    grpc_front = GrpcFrontend(service, config, auth)
    stream_front: StreamServer | None = None
    if config.peer_stream_port >= 0 and (stream_tls or not config.curve_secret_key_file):
        stream_front = StreamServer(
            service, auth, host=config.host, port=config.peer_stream_port,
            timeout_s=config.peer_timeout_s, tls=stream_tls,
            max_payload_bytes=config.max_message_bytes,
            max_reserved_bytes=config.stream_put_max_reserved,
        )  # fmt: skip
    reaper: asyncio.Task[None] | None = None
    ssd: SsdTier | None = None
    node: ClusterNode | None = None
    metrics_server = None
    try:
        # the tiers below DRAM, fastest first (kvserver/daemon/tiers.py)
        tier_config = config.tier_config()
        if tier_config is not None:
            ssd = SsdTier(
                service.engine,
                tier_config,
                publish=service.publish,
                max_promotions=config.ssd_promotions,
            )
            service.add_tier(ssd)
        if config.peer_addresses:
            service.add_tier(static_peer_tier(config, service))
        await service.open_tiers()
        if ssd is not None and ssd.opened:
            _warn_if_the_disk_is_smaller(config.ssd_dir, config.ssd)
        step("tiers")
        data_port, pub_port = await zmq_front.start()
        stream_port = await stream_front.start() if stream_front is not None else -1
        service.peer_stream = stream_front
        zmq_front.announce_peer_stream(
            stream_port if stream_port >= 0 else None, tls=stream_tls is not None
        )
        grpc_port = await grpc_front.start()
        tcp_ports = {data_port, grpc_port} | ({stream_port} if stream_port >= 0 else set())
        if token:
            token_files = write_token_files(token, tcp_ports, config.shm_dir)
        else:  # a file left for these ports by a daemon that was SIGKILLed is stale now
            remove_token_files(token_path(p, config.shm_dir) for p in tcp_ports)
        step("listen")
        reaper = asyncio.create_task(_reap_forever(service, config.reap_interval_s))
        collector = DaemonCollector(service, asyncio.get_running_loop())
        metrics_port, metrics_server = serve_metrics(collector, config.host, config.metrics_port)
        dram_bytes = service.dram_bytes
        stream_scheme = "tls" if stream_tls is not None else "tcp"
        node = await _join_fleet(config, service, data_port, grpc_port,
                                 (stream_scheme, stream_port), ssd)  # fmt: skip
        if node is not None:  # the network tier over the fleet index, at the bottom
            peer_tier = fleet_peer_tier(config, service, node)
            service.add_tier(peer_tier)
            await peer_tier.open()
        step("fleet")
        info: dict[str, object] = {
            "pid": os.getpid(),
            "host": config.host,
            "grpc_port": grpc_port,
            "zmq_port": data_port,
            "pub_port": pub_port,
            "peer_stream_port": stream_port,
            "peer_stream_tls": stream_tls is not None and stream_port >= 0,
            "metrics_port": metrics_port,
            "arena_path": service.arena_path,
            "dram_bytes": dram_bytes,
            "ssd_dir": config.ssd_dir,
            "ssd_condition": ssd.condition if ssd is not None else "",
            "ssd_recovered_chunks": ssd.counters.recovered_chunks if ssd is not None else 0,
            "malloc_tuned": malloc_tuned,
            "cluster_host_id": node.host_id if node is not None else "",
            "cluster_incarnation": node.incarnation if node is not None else "",
            "cluster_condition": node.condition if node is not None else "",
        }
        if serving is not None:
            serving()
        settle_gc()
        logger.info("kvserver listening: %s", listening_line(config, info, token))
        if config.ready_file:  # after the line above: whoever waits for it may read the log
            try:
                write_atomic(config.ready_file, json.dumps(info))
            except OSError as exc:  # preflight wrote there: the directory changed since
                raise KVServerError(f"cannot write --ready-file: {exc}") from None
        await stop.wait()
        if leaving is not None:
            arena = service.arena_path
            tokens = token_files.paths if token_files is not None else []
            leaving([arena, f"{arena}.sock", *tokens, *filter(None, [config.ready_file])])
        logger.info("shutting down")
    finally:
        if node is not None:  # leave the fleet first: peers stop routing here
            await node.stop()
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)  # a scrape in flight needs the loop
            metrics_server.server_close()
        await grpc_front.stop(SHUTDOWN_GRACE_S)
        await zmq_front.stop()
        if stream_front is not None:
            await stream_front.stop()
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await service.close_tiers()
        service.close()
        if token_files is not None:
            token_files.close()
        if config.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config.ready_file)
        logger.info("stopped; shared-memory arena removed")
    return ssd.abandoned_jobs if ssd is not None else 0


def _warn_if_the_disk_is_smaller(directory: str, capacity: int) -> None:
    """Warn when the SSD tier's filesystem cannot hold ``capacity``: the tier would go
    ``degraded`` once the disk is full (ENOSPC), long after start-up. Not an error: the disk
    may be shared, or grow."""
    room = disk_room(directory)
    if room is not None and room < capacity:
        logger.warning(
            "SSD tier: --ssd %d MiB, but its filesystem has room for %d MiB in %s: the tier "
            "will go degraded when the disk fills; give --ssd %d MiB at most, or free space",
            capacity >> 20, room >> 20, directory, room >> 20,
        )  # fmt: skip


async def _join_fleet(
    config: DaemonConfig,
    service: KVService,
    data_port: int,
    grpc_port: int,
    stream: tuple[str, int],
    tier: SsdTier | None,
) -> ClusterNode | None:
    """Register this daemon in its fleet (``--cluster``); None when standalone. ``stream``:
    the peer stream's scheme (``tcp``, ``tls``) and port (-1: none). Never fails for Redis:
    an unreachable Redis leaves the node ``unavailable`` and retried."""
    cluster_config = config.cluster_config()
    if cluster_config is None:
        return None
    from kvserver.cluster.schema import HostInfo
    from kvserver.netaddr import host_port

    host = config.advertised_host
    from kvserver.cluster.config import advertised_beyond_reach

    unreachable = advertised_beyond_reach(host, cluster_config.target())
    if unreachable:
        logger.warning("cluster: %s", unreachable)
    capacity = {"dram": service.dram_bytes}
    if tier is not None and config.tier_config() is not None:
        capacity["ssd"] = config.ssd
    identity = HostInfo(
        host_id=check_host_id(config.member_id),
        incarnation="",
        data_address=f"tcp://{host_port(host, data_port)}",
        grpc_address=host_port(host, grpc_port),
        stream_address=f"{stream[0]}://{host_port(host, stream[1])}" if stream[1] >= 0 else "",
        tiers=tuple(capacity),
        capacity=capacity,
    )
    node = ClusterNode(
        cluster_config,
        identity,
        service.events,
        service.held_chunks,
        lambda: {s.ns_id: json.dumps(s.to_dict()) for s in service.list_namespaces()},
    )
    await node.start()
    service.cluster = node
    return node


class _Progress:
    """A tqdm bar over bytes on stderr, shown only when stderr is a terminal (tqdm's
    ``disable=None``); call it as ``progress(done, total)``."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._bar: tqdm[Any] | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = tqdm(
                desc=self._what, total=total, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, file=sys.stderr, leave=False,
            )  # fmt: skip
        self._bar.update(done - self._bar.n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.refresh()  # draw the last state (updates within mininterval are not drawn)
            self._bar.close()


async def _reap_forever(service: KVService, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            service.expire()
        except Exception:  # never let housekeeping kill the daemon
            logger.exception("lease reaper failed")


def settle_gc() -> None:
    """Once started: collect what start-up left, freeze what survived (modules, the engine, the
    front ends: alive until exit) so that no collection walks it again, and collect the young
    generation every :data:`GC_YOUNG_THRESHOLD` new objects. Reference counting frees almost
    everything a request allocates; the cycle collector is for the rest, and a full pass over
    start-up's ~50k objects takes 50-70 ms on the loop (issue 15)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def main(config: DaemonConfig) -> int:
    """Run the daemon in this process; returns the exit code (0 on orderly shutdown)."""
    malloc_tuned = config.tune_malloc and tune_malloc()  # first: before any thread exists
    # A thread doing Python work (a large request validated or hashed off the loop, SSD I/O)
    # hands the GIL back to the loop after at most this long (default 5 ms: the loop's stall).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if config.tune_malloc and not malloc_tuned:
        logger.info("glibc allocator settings not applied (not glibc, or refused)")
    import uvloop

    async def _main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        signals = StopSignals(stop)

        def take_over() -> None:  # once serving: the loop's handlers (HUP: terminal closed)
            signals.install(loop)

        def leaving(paths: list[str]) -> None:  # the shutdown began: a later signal exits
            signals.arm(Leaving(files=paths), FORCED_EXIT_NOTE)

        with forward(stop.set):  # until then: a signal recorded stops start-up at its next step
            return await serve(
                config, stop, malloc_tuned=malloc_tuned, serving=take_over, leaving=leaving
            )

    with recording():  # from here when not run by ``kvserver start`` (which records already)
        abandoned = uvloop.run(_main())
    if abandoned:
        # disk jobs still hang in the kernel past the drain timeout: the interpreter's exit
        # would join their threads (wait for them) whatever the timeout said; everything
        # else is closed by now (the arena and the token files removed)
        logging.shutdown()
        os._exit(0)
    return 0
