"""The gRPC front end: Lookup / Pin / Stats / namespaces / WatchEvents semantics in one process
(GrpcFrontend over a KVService on a uvloop loop in a background thread, populated directly),
then the real daemon process: health, reflection, Stats, a store over ZMQ seen by Lookup and
WatchEvents, resume without gaps across a disconnect, SIGTERM → exit 0 with the arena removed.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.grpc_server import STATUS_BY_CODE, GrpcFrontend, status_for
from kvserver.daemon.service import KVService
from kvserver.engine.types import HashedKeys
from kvserver.errors import (
    ERRORS_BY_CODE,
    CapacityError,
    InvalidArgument,
    Unauthenticated,
    UnknownNamespace,
)
from kvserver.events import BlockRemoved, BlockStored, Event
from kvserver.grpc_client import EventsDropped, GrpcClient
from kvserver.hashing import HASH_ALGOS, BlockHasher
from kvserver.namespace import NamespaceSpec
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.test_hashing import reference_hashes
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon, wait_until

T = TypeVar("T")
PAGE = 4096


class InProcessServer:
    """KVService + GrpcFrontend on a uvloop event loop in a background thread: the daemon's
    shape (one loop owns the service) in the test process. Service calls go through
    :meth:`call`, which runs them on that loop. Close it (stops the frontend, removes the arena).
    """

    def __init__(self, shm_dir: Path, *, event_capacity: int = 100_000, **config: Any) -> None:
        self.config = DaemonConfig(
            grpc_port=0,
            dram=256 * PAGE,
            page_size=PAGE,
            shm_dir=str(shm_dir),
            event_capacity=event_capacity,
            **config,
        )
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop")
        self._thread.start()
        self.service = self.call(
            lambda: KVService(self.config.engine_config(), event_capacity=event_capacity)
        )
        self.frontend = self.call(lambda: GrpcFrontend(self.service, self.config))
        self.port = self.run(self.frontend.start())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def on_loop() -> T:
            return fn()

        result: T = self.run(on_loop())
        return result

    def client(self, **kwargs: Any) -> GrpcClient:
        return GrpcClient(self.address, timeout=10.0, **kwargs)

    def register(self, spec: NamespaceSpec) -> str:
        return str(self.call(lambda: self.service.register_namespace(spec))["ns_id"])

    def store(self, ns_id: str, keys: list[bytes]) -> None:
        """Make ``keys`` READY (payload is irrelevant to the query API)."""

        def do() -> None:
            grant = self.service.prepare_store(ns_id, keys, client="test")
            assert grant is not None
            if grant.keys:
                self.service.complete_store(grant.lease_id)

        self.call(do)

    def stop(self, grace: float = 5.0) -> None:
        self.run(self.frontend.stop(grace))

    def close(self) -> None:
        self.stop()
        self.call(self.service.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def chunk_keys(spec: NamespaceSpec, tokens: list[int], **kw: Any) -> list[bytes]:
    """The keys a vLLM replica of ``spec`` computes (independent of the daemon)."""
    hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
    return [
        bytes(k) for k in hasher.chunk_keys(hasher.hash_blocks(tokens, **kw), spec.chunk_blocks)
    ]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    srv = InProcessServer(tmp_path)
    yield srv
    srv.close()


@pytest.fixture
def client(server: InProcessServer) -> Iterator[GrpcClient]:
    with server.client() as c:
        yield c


# ----------------------------------------------------------------------------- in process


def test_frontend_runs_on_uvloop(server: InProcessServer, client: GrpcClient) -> None:
    """grpc.aio serves on a uvloop loop (the daemon's production loop)."""
    assert isinstance(server.loop, uvloop.Loop)
    assert client.health() == "SERVING"
    assert client.health("kvserver.v1.KVServer") == "SERVING"


def test_lookup_tokens_agrees_with_vllm_hashing(
    server: InProcessServer, client: GrpcClient
) -> None:
    spec = make_spec(chunk_blocks=2)
    ns_id = client.register_namespace(spec).namespace_id
    tokens = list(range(1000, 1000 + 32 * 10 + 7))  # 10 full chunks of 32 tokens + a tail
    keys = chunk_keys(spec, tokens)
    assert len(keys) == 10
    server.store(ns_id, keys[:6])
    reply = client.lookup_tokens(ns_id, tokens)
    assert (reply.hit_chunks, reply.hit_tokens, reply.num_chunks) == (6, 6 * 32, 10)
    assert reply.chunk_tokens == 32 and reply.tiers == {"dram": 6}
    assert client.lookup_keys(ns_id, keys) == reply


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_token_keys_are_hashed_keys_of_the_namespace_size(
    server: InProcessServer, client: GrpcClient, algo: str
) -> None:
    """The token paths hand the engine ``HashedKeys`` (trusted, not checked per key): each
    one the namespace's key size, the same keys a client's own hasher computes."""
    spec = make_spec(hash_algo=algo)
    ns_id = client.register_namespace(spec).namespace_id
    tokens = list(range(16 * 40))
    keys = server.call(lambda: server.service.prompts.chunk_keys_for_tokens(ns_id, tokens))
    assert type(keys) is HashedKeys and keys.key_size == spec.key_size
    assert list(keys) == chunk_keys(spec, tokens)
    assert {type(k) for k in keys} == {bytes} and {len(k) for k in keys} == {spec.key_size}
    server.store(ns_id, list(keys[:30]))
    assert client.lookup_tokens(ns_id, tokens).hit_chunks == 30


def test_lookup_is_a_leading_run(server: InProcessServer, client: GrpcClient) -> None:
    ns_id = client.register_namespace(make_spec()).namespace_id
    keys = make_keys(8)
    server.store(ns_id, keys[:3] + keys[4:])  # chunk 3 missing
    assert client.lookup_keys(ns_id, keys).hit_chunks == 3
    assert client.lookup_keys(ns_id, keys[4:]).hit_chunks == 4
    empty = client.lookup_keys(ns_id, [])
    assert (empty.hit_chunks, empty.num_chunks, empty.tiers) == (0, 0, {"dram": 0})


def test_cache_salt_and_lora_change_the_keys(server: InProcessServer, client: GrpcClient) -> None:
    spec = make_spec(hash_algo="xxhash_cbor")
    ns_id = client.register_namespace(spec).namespace_id
    tokens = list(range(64))
    salted = chunk_keys(spec, tokens, cache_salt="tenant-a", lora=("ad", "/p"))
    assert len(salted[0]) == 16
    server.store(ns_id, salted)
    assert client.lookup_tokens(ns_id, tokens).hit_chunks == 0
    hit = client.lookup_tokens(ns_id, tokens, cache_salt="tenant-a", lora=("ad", "/p"))
    assert hit.hit_chunks == 4
    assert (
        client.lookup_tokens(ns_id, tokens, cache_salt="tenant-b", lora=("ad", "/p")).hit_chunks
        == 0
    )


def test_lookup_errors_are_typed(server: InProcessServer, client: GrpcClient) -> None:
    ns_id = client.register_namespace(make_spec()).namespace_id
    with pytest.raises(UnknownNamespace):
        client.lookup_keys("0123456789abcdef", make_keys(1))
    with pytest.raises(InvalidArgument, match="32 bytes"):
        client.lookup_keys(ns_id, [b"short"])
    with pytest.raises(InvalidArgument, match="namespace_id is required"):
        client.lookup_keys("", make_keys(1))


def test_pin_keeps_a_prefix_through_eviction(server: InProcessServer, client: GrpcClient) -> None:
    """An agent pins its conversation prefix across a tool call; a flood of other chunks
    evicts everything else but not the pinned prefix; after Unpin it can go."""
    spec = make_spec()
    ns_id = client.register_namespace(spec).namespace_id
    tokens = list(range(16 * 4))
    prefix = chunk_keys(spec, tokens)
    server.store(ns_id, prefix)
    pinned = client.pin(ns_id, token_ids=tokens, ttl_s=60)
    assert (pinned.chunks, pinned.num_chunks) == (4, 4)
    assert client.stats().tiers[0].pinned_bytes == 4 * PAGE
    for start in range(0, 512, 64):  # 2x the arena in other chunks
        server.store(ns_id, make_keys(64, start=start, tag="flood"))
    assert client.lookup_tokens(ns_id, tokens).hit_chunks == 4
    unpinned = client.unpin(ns_id, keys=prefix)
    assert (unpinned.chunks, unpinned.num_chunks) == (4, 4)
    assert client.stats().tiers[0].pinned_bytes == 0
    server.store(ns_id, make_keys(256, tag="flood2"))
    assert client.lookup_keys(ns_id, prefix).hit_chunks == 0


def test_pin_validates_ttl_and_prefix(server: InProcessServer, client: GrpcClient) -> None:
    ns_id = client.register_namespace(make_spec()).namespace_id
    for ttl in (0.0, -1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(InvalidArgument):
            client.pin(ns_id, keys=make_keys(1), ttl_s=ttl)
    assert client.pin(ns_id, keys=make_keys(2), ttl_s=5).chunks == 0  # absent: skipped
    with pytest.raises(InvalidArgument, match="exactly one"):
        client.pin(ns_id, ttl_s=5)


def test_namespaces_register_list_and_errors(client: GrpcClient) -> None:
    a = client.register_namespace(make_spec(model="m/a"))
    assert client.register_namespace(make_spec(model="m/a")) == a  # idempotent
    b = client.register_namespace(make_spec(model="m/b", hash_algo="sha256", label="ops"))
    assert a.spec == make_spec(model="m/a") and a.key_size == 32 and a.chunk_tokens == 16
    assert (
        b.spec.label == "ops" and b.namespace_id == make_spec(model="m/b", hash_algo="sha256").ns_id
    )
    assert {n.namespace_id for n in client.list_namespaces()} == {a.namespace_id, b.namespace_id}
    assert [n.namespace_id for n in client.list_namespaces("m/b")] == [b.namespace_id]
    assert client.list_namespaces("nope") == []
    with pytest.raises(CapacityError):  # one chunk larger than the whole (1 MiB) arena
        client.register_namespace(make_spec(num_layers=4096))


def test_stats_per_tier_and_namespace(server: InProcessServer, client: GrpcClient) -> None:
    ns_id = client.register_namespace(make_spec(model="stats/m")).namespace_id
    keys = make_keys(5)
    server.store(ns_id, keys[:3])
    client.lookup_keys(ns_id, keys)
    stats = client.stats()
    (dram,) = stats.tiers
    assert (dram.name, dram.medium, dram.policy) == ("dram", "CPU", "chain")
    assert dram.capacity_bytes == 256 * PAGE and dram.used_bytes == 3 * PAGE
    assert (dram.entries, dram.hit_chunks, dram.miss_chunks, dram.evicted_chunks) == (3, 3, 2, 0)
    (ns,) = stats.namespaces
    assert (ns.namespace_id, ns.model, ns.entries, ns.bytes) == (ns_id, "stats/m", 3, 3 * PAGE)
    assert (ns.lookups, ns.hit_chunks, ns.miss_chunks, ns.stored_chunks) == (1, 3, 2, 3)
    assert ns.tiers == {"dram": (3, 3 * PAGE)}
    assert stats.events_last_seq == 1 and stats.events_oldest_seq == 1
    assert stats.event_log_id == server.frontend.log_id
    assert stats.to_dict()["tiers"][0]["name"] == "dram"


def _take(stream: Iterator[Event], n: int) -> list[Event]:
    return [next(stream) for _ in range(n)]


def test_watch_events_replays_follows_and_resumes(
    server: InProcessServer, client: GrpcClient
) -> None:
    """A subscriber reads 3 events, disconnects while 4 more happen, reconnects with
    (next_seq, log_id) and gets exactly the 4 it missed, then live ones."""
    ns_id = client.register_namespace(make_spec()).namespace_id
    keys = make_keys(40)
    with client.watch_events() as live:  # from_seq 0: only new events
        assert live.next_seq == 1 and live.log_id == server.frontend.log_id
        for i in range(3):
            server.store(ns_id, keys[i : i + 1])
        seen = _take(live, 3)
        resume_at, log_id = live.next_seq, live.log_id
    assert [e.seq for e in seen] == [1, 2, 3] and resume_at == 4
    assert all(isinstance(e, BlockStored) and e.ns_id == ns_id and e.medium == "CPU" for e in seen)
    for i in range(3, 7):
        server.store(ns_id, keys[i : i + 1])
    with client.watch_events(resume_at, log_id=log_id) as again:
        missed = _take(again, 4)
        server.store(ns_id, keys[7:9])
        (live_event,) = _take(again, 1)
    assert [e.seq for e in missed] == [4, 5, 6, 7]
    assert [getattr(e, "keys", None) for e in missed] == [(k,) for k in keys[3:7]]
    assert live_event.seq == 8 and live_event.keys == tuple(keys[7:9])  # type: ignore[union-attr]
    server.store(ns_id, make_keys(256, tag="evict"))  # evictions: BlockRemoved
    with client.watch_events(9) as tail:
        kinds = {type(e) for e in _take(tail, 2)}
    assert kinds == {BlockRemoved, BlockStored}


def test_watch_events_out_of_range(tmp_path: Path) -> None:
    srv = InProcessServer(tmp_path, event_capacity=4)
    try:
        with srv.client() as client:
            ns_id = client.register_namespace(make_spec()).namespace_id
            for i, key in enumerate(make_keys(6)):
                srv.store(ns_id, [key])
                assert srv.service.events.last_seq == i + 1
            with pytest.raises(EventsDropped, match="resume from seq 3") as dropped:
                next(client.watch_events(1))
            assert dropped.value.oldest_seq == 3
            with pytest.raises(EventsDropped, match="beyond"):
                next(client.watch_events(9))
            with pytest.raises(EventsDropped, match="restarted"):
                next(client.watch_events(3, log_id="0" * 16))
            with client.watch_events(3, log_id=srv.frontend.log_id) as ok:
                assert [e.seq for e in _take(ok, 4)] == [3, 4, 5, 6]
    finally:
        srv.close()


def test_watch_events_streams_past_the_bound_are_refused(tmp_path: Path) -> None:
    """Every event is written to every WatchEvents stream on the loop, and nothing bounded
    their number: one caller could open thousands (2,000 stalled streams cut another
    client's stores in 6 s from 17,226 to 3,860). Past max_event_watchers a stream is
    RESOURCE_EXHAUSTED; the open ones still get every event; a closed one frees its place."""
    srv = InProcessServer(tmp_path, max_event_watchers=2)
    try:
        with srv.client() as client:
            ns_id = client.register_namespace(make_spec()).namespace_id
            first, second = client.watch_events(), client.watch_events()
            assert first.next_seq == second.next_seq == 1  # both established
            with pytest.raises(CapacityError, match="max_event_watchers"):
                next(client.watch_events())
            srv.store(ns_id, make_keys(1, tag="watched"))
            assert [e.seq for e in _take(first, 1)] == [1] == [e.seq for e in _take(second, 1)]
            first.close()

            def admitted() -> bool:
                try:
                    stream = client.watch_events()
                    ok = stream.next_seq == 2
                except CapacityError:  # the closed stream's handler has not ended yet
                    return False
                stream.close()
                return ok

            wait_until(admitted)
            second.close()
    finally:
        srv.close()


def test_stop_ends_streams_and_stops_serving(server: InProcessServer, client: GrpcClient) -> None:
    stream = client.watch_events()
    assert stream.next_seq == 1  # the stream is established
    started = time.monotonic()
    server.stop(grace=30.0)
    assert time.monotonic() - started < 10.0  # streams end at once, not after the grace
    assert list(stream) == []  # ended with OK
    with pytest.raises(Exception, match="unreachable"):
        client.stats(timeout=2.0)


def test_health_turns_not_serving_on_shutdown(server: InProcessServer) -> None:
    """A load balancer watching health sees NOT_SERVING as soon as shutdown begins."""
    with grpc.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="kvserver.v1.KVServer"), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopped = asyncio.run_coroutine_threadsafe(server.frontend.stop(1.0), server.loop)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stopped.result(30)
        watch.cancel()


def test_auth_token_required_on_kvserver_rpcs_only(tmp_path: Path) -> None:
    srv = InProcessServer(tmp_path, auth_token="s3cret")
    try:
        with srv.client() as anon, srv.client(auth_token="wrong") as wrong:
            for c in (anon, wrong):
                with pytest.raises(Unauthenticated):
                    c.stats()
                with pytest.raises(Unauthenticated):
                    c.list_namespaces()
                with pytest.raises(Unauthenticated):
                    next(c.watch_events())
                assert c.health() == "SERVING"  # health stays open
        with srv.client(auth_token="s3cret") as good:
            ns_id = good.register_namespace(make_spec()).namespace_id
            assert good.lookup_keys(ns_id, make_keys(2)).num_chunks == 2
    finally:
        srv.close()


def test_every_error_code_has_a_status() -> None:
    assert set(ERRORS_BY_CODE) <= set(STATUS_BY_CODE)
    assert status_for(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(UnknownNamespace("x")) == grpc.StatusCode.NOT_FOUND
    assert status_for(Unauthenticated("x")) == grpc.StatusCode.UNAUTHENTICATED

    class Custom(InvalidArgument):
        code = "brand_new"

    assert status_for(Custom("x")) == grpc.StatusCode.INVALID_ARGUMENT


def test_bind_failure_is_a_clear_error(server: InProcessServer, tmp_path: Path) -> None:
    config = server.config.replace(grpc_port=server.port)
    other = server.call(lambda: GrpcFrontend(server.service, config))
    with pytest.raises(Exception, match="cannot bind gRPC"):
        server.run(other.start())


# ----------------------------------------------------------------------------- real daemon


def zmq_put(daemon: DaemonProc, ns_id: str, keys: list[bytes], part_bytes: int) -> None:
    """Store ``keys`` through the daemon's ZMQ data plane (one ``put``)."""
    import zmq

    from kvserver import wire

    ctx = zmq.Context()
    try:
        sock = raw_dealer(daemon.zmq_address, ctx=ctx)
        args = {"ns_id": ns_id, "keys": keys}
        header = wire.encode_request(1, wire.PUT, args, auth=daemon.token, client="t")
        sock.send_multipart([header, *(bytes(part_bytes) for _ in keys)])
        assert sock.poll(20_000), "no reply to put"
        reply = wire.decode_reply(sock.recv_multipart()[0])
        assert reply.ok, reply
        sock.close()
    finally:
        ctx.term()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    proc = start_daemon(tmp_path_factory.mktemp("grpc-daemon"), "--dram", "4MiB")
    try:
        yield proc
        assert proc.terminate() == 0  # orderly: the arena file is removed
    finally:
        proc.kill()


@pytest.mark.multiprocess
def test_daemon_health_and_reflection(daemon: DaemonProc) -> None:
    with grpc.insecure_channel(daemon.grpc_address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "kvserver.v1.KVServer"):
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "kvserver.v1.KVServer" in services and "grpc.health.v1.Health" in services
        desc = db.FindFileContainingSymbol("kvserver.v1.KVServer")
        assert desc.package == "kvserver.v1"


@pytest.mark.multiprocess
def test_daemon_lookup_stats_and_events(daemon: DaemonProc) -> None:
    """Register over gRPC, store over ZMQ, then Lookup by tokens, Stats and a WatchEvents
    stream that survives a disconnect without a gap."""
    spec = make_spec(model="real/m")
    with GrpcClient(daemon.grpc_address, timeout=10) as client:
        ns = client.register_namespace(spec)
        assert ns.namespace_id in {n.namespace_id for n in client.list_namespaces("real/m")}
        start = client.stats().events_last_seq + 1
        tokens = list(range(16 * 6))
        keys = chunk_keys(spec, tokens)
        with client.watch_events(start) as stream:
            zmq_put(daemon, ns.namespace_id, keys[:2], ns.part_bytes)
            first = next(stream)
            resume, log_id = stream.next_seq, stream.log_id
        zmq_put(daemon, ns.namespace_id, keys[2:4], ns.part_bytes)
        zmq_put(daemon, ns.namespace_id, keys[4:5], ns.part_bytes)
        with client.watch_events(resume, log_id=log_id) as stream:
            rest = [next(stream), next(stream)]
        assert [e.seq for e in (first, *rest)] == [start, start + 1, start + 2]
        assert [k for e in (first, *rest) for k in e.keys] == keys[:5]  # type: ignore[union-attr]
        reply = client.lookup_tokens(ns.namespace_id, tokens)
        assert (reply.hit_chunks, reply.hit_tokens, reply.tiers) == (5, 80, {"dram": 5})
        stats = client.stats()
        assert stats.tiers[0].capacity_bytes == 4 << 20
        (row,) = [n for n in stats.namespaces if n.namespace_id == ns.namespace_id]
        assert (row.entries, row.stored_chunks) == (5, 5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_daemon_lookup_of_a_long_new_prompt_matches_the_literal_scheme(
    daemon: DaemonProc, algo: str
) -> None:
    """Lookup by token ids of a never-seen 80-block prompt (the bulk CBOR encoder, then the
    segment cache), ids of every width, salted and with a LoRA: the daemon's keys are the
    scheme's spelled out block by block."""
    spec = make_spec(model=f"real/long-{algo}", hash_algo=algo, chunk_blocks=1)
    rng = random.Random(algo)
    edges = [0, 23, 24, 255, 256, 65535, 65536, 2**31, 2**32 - 1]
    tokens = [
        rng.choice(edges) if rng.random() < 0.3 else rng.randrange(2 ** rng.randrange(1, 33))
        for _ in range(16 * 80 + 5)
    ]
    extra: dict[str, Any] = {"cache_salt": "tenant", "lora": ("ad", "/p")}
    keys = reference_hashes(algo, tokens, 16, seed=spec.hash_seed, **extra)  # 1 block a chunk
    with GrpcClient(daemon.grpc_address, timeout=10) as client:
        ns_id = client.register_namespace(spec).namespace_id
        zmq_put(daemon, ns_id, keys[:50], spec.part_bytes)
        for _ in range(2):  # hashed, then from the daemon's segment cache
            reply = client.lookup_tokens(ns_id, tokens, **extra)
            assert (reply.hit_chunks, reply.num_chunks) == (50, 80)
        other = client.lookup_tokens(ns_id, tokens, cache_salt="other", lora=("ad", "/p"))
        assert other.hit_chunks == 0
        assert client.lookup_tokens(ns_id, tokens[:-5] + [1] * 16, **extra).hit_chunks == 50


@pytest.mark.multiprocess
def test_sigterm_exits_0_and_removes_the_arena(tmp_path: Path) -> None:
    proc = start_daemon(tmp_path, "--dram", "2MiB")
    try:
        assert os.path.exists(proc.arena_path)
        with GrpcClient(proc.grpc_address, timeout=10) as client:
            stream = client.watch_events()
            assert stream.next_seq == 1
            assert proc.terminate() == 0
            assert list(stream) == []  # the open stream ended cleanly
    finally:
        proc.kill()
    assert not os.path.exists(proc.arena_path)
