"""``ScoreHosts`` (gRPC) and ``kvserver lookup --fleet`` across three real daemons on one Redis.

Chunks stored through A (all 12) and B (the first 5), none through C: asked through C (which
has not even registered the namespace: it hashes the prompt with the spec A published), the
hosts come back best first with their runs per tier and weighted scores; candidates restrict
the answer; a daemon outside any fleet answers FAILED_PRECONDITION; Stats and ``kvserver
status`` show the fleet.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.client import KVClient
from kvserver.cluster.rpc import call_score_hosts
from kvserver.daemon.prompt_hashing import HASH_OFF_LOOP_TOKENS
from kvserver.errors import InvalidArgument, InvalidState, UnknownNamespace
from kvserver.grpc_client import GrpcClient
from kvserver.hashing import BlockHasher
from tests.kvserver.builders import make_spec, pattern
from tests.kvserver.cluster.test_fleet_daemons import start_host
from tests.kvserver.daemon.test_memory_bounds import MIB, rss
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.redis import RedisServer

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/fleet")
TOKENS = [(i * 7919) % 5000 for i in range(12 * SPEC.chunk_tokens)]


def chunk_keys(tokens: list[int]) -> list[bytes]:
    h = BlockHasher(SPEC.hash_algo, SPEC.block_size, SPEC.hash_seed)
    return [bytes(k) for k in h.chunk_keys(h.hash_blocks(tokens), SPEC.chunk_blocks)]


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServer) -> Iterator[list[DaemonProc]]:
    procs = [start_host(tmp_path, redis_server, name) for name in ("a", "b", "c")]
    keys = chunk_keys(TOKENS)
    for d, n in zip(procs, (12, 5, 0), strict=True):
        if n:
            with KVClient(d.zmq_address) as kv:
                ns_id = kv.register_namespace(SPEC).ns_id
                parts = [[pattern(k, 0, SPEC.part_bytes)] for k in keys[:n]]
                assert kv.store(ns_id, keys[:n], parts) == keys[:n]
    with GrpcClient(procs[2].grpc_address) as c:
        wait_until(lambda: _top(c) == [("a", 12), ("b", 5), ("c", 0)], timeout=10.0)
    yield procs
    for d in procs:
        d.kill()


def _top(client: GrpcClient) -> list[tuple[str, int]]:
    scored = call_score_hosts(client, SPEC.ns_id, keys=chunk_keys(TOKENS))
    return [(h.host_id, h.hit_chunks) for h in scored]


def redis_calls(redis: RedisServer, command: str) -> int:
    stats = redis.cli("INFO", "commandstats")
    head = f"cmdstat_{command}:calls="
    return int(stats.split(head)[1].split(",")[0]) if head in stats else 0


def test_hosts_are_scored_best_first_with_their_runs_per_tier(
    fleet: list[DaemonProc], redis_server: RedisServer
) -> None:
    a, b, c = fleet
    ct = SPEC.chunk_tokens
    # C has no such namespace: it read A's spec from the fleet once, and keeps it (an ns id
    # is a digest of the spec)
    hgets = redis_calls(redis_server, "hget")
    assert hgets >= 1
    with GrpcClient(c.grpc_address) as client:
        for exact in (False, True):
            by_tokens = call_score_hosts(client, SPEC.ns_id, token_ids=TOKENS, exact=exact)
            assert [(h.host_id, h.hit_tokens, h.score) for h in by_tokens] == [
                ("a", 12 * ct, 12 * ct * 1.0),
                ("b", 5 * ct, 5 * ct * 1.0),
                ("c", 0, 0.0),
            ]
        assert by_tokens[0].tiers == {"dram": 12 * ct, "ssd": 0}
        assert by_tokens[0].data_address == a.zmq_address
        assert by_tokens[1].grpc_address == b.grpc_address
        longer = TOKENS + [1] * (HASH_OFF_LOOP_TOKENS + 1)  # hashed on a thread, same runs
        by_long = call_score_hosts(client, SPEC.ns_id, token_ids=longer)
        assert [(h.host_id, h.hit_chunks) for h in by_long] == [("a", 12), ("b", 5), ("c", 0)]
        only = call_score_hosts(client, SPEC.ns_id, token_ids=TOKENS, candidate_hosts=["b", "c"])
        assert [h.host_id for h in only] == ["b", "c"]
        weighted = call_score_hosts(
            client, SPEC.ns_id, keys=chunk_keys(TOKENS), tier_weights={"dram": 0.25}
        )
        assert weighted[0].score == 12 * ct * 0.25
        with pytest.raises(UnknownNamespace):
            call_score_hosts(client, "0" * 16, token_ids=TOKENS)
        keys = chunk_keys(TOKENS)
        for bad in ([keys[0][:-1]], [*keys[:3], keys[3] + b"x"]):  # every key is checked
            with pytest.raises(InvalidArgument, match="key_size"):
                call_score_hosts(client, SPEC.ns_id, keys=bad)
        assert call_score_hosts(client, SPEC.ns_id, keys=[])[0].hit_chunks == 0
        # a prompt is held to the chunks a keys request may carry (65,536), before hashing
        many_chunks = [1] * (((1 << 16) + 1) * SPEC.chunk_tokens)
        with pytest.raises(InvalidArgument, match="more chunks"):
            call_score_hosts(client, SPEC.ns_id, token_ids=many_chunks)
        with pytest.raises(InvalidArgument, match="too many tokens"):
            call_score_hosts(client, SPEC.ns_id, token_ids=[1] * ((1 << 21) + 1))
        assert redis_calls(redis_server, "hget") == hgets + 1  # the unknown one: not cached
        stats = client.stats()
        assert stats.cluster is not None and stats.cluster["condition"] == "ok"
        assert stats.cluster["host_id"] == "c" and stats.cluster["live_hosts"] == 3


def test_lookup_fleet_and_status_print_the_fleet(fleet: list[DaemonProc]) -> None:
    c = fleet[2]
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    tokens = ",".join(map(str, TOKENS))
    base = [sys.executable, "-m", "kvserver.cli"]
    out = subprocess.run(
        [*base, "lookup", "--server", c.grpc_address, "--model", SPEC.model, "--fleet",
         "--namespace", SPEC.ns_id, "--tokens", tokens, "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    ).stdout  # fmt: skip
    hosts = json.loads(out)["hosts"]
    assert [(h["host_id"], h["hit_chunks"]) for h in hosts] == [("a", 12), ("b", 5), ("c", 0)]
    table = subprocess.run(
        [*base, "lookup", "--server", c.grpc_address, "--model", SPEC.model, "--fleet",
         "--namespace", SPEC.ns_id, "--tokens", tokens],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert table.splitlines()[1].split()[:2] == ["HOST", "SCORE"]
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["a", "b", "c"]
    status = subprocess.run(
        [*base, "status", "--server", c.grpc_address],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "fleet redis://" in status and ": ok  as c" in status


def test_a_standalone_daemon_refuses_score_hosts(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    try:
        with GrpcClient(d.grpc_address) as client:
            with pytest.raises(InvalidState):
                call_score_hosts(client, SPEC.ns_id, token_ids=TOKENS)
            assert client.stats().cluster is None
    finally:
        d.kill()


def test_hostile_candidate_lists_and_tier_weights_are_refused_before_they_cost(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """ScoreHosts from an authenticated caller, one daemon of a fleet: 1,500,000 candidate
    hosts (12 MB) were made into Python strings, a list and two sets (peak RSS +254 MB, ~1.2 s
    of the daemon's loop) and answered OK; now INVALID_ARGUMENT at their count, as is a
    tier_weights map of more entries than there are tiers (350,000: converted to a dict before
    its first unknown name was refused). Duplicate candidates answer each host once; NaN,
    infinite and negative weights are refused; the daemon serves on."""
    d = start_host(tmp_path, redis_server, "a")
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
        keys = chunk_keys(TOKENS)[:2]
        with grpc.insecure_channel(
            d.grpc_address, options=[("grpc.max_send_message_length", 64 << 20)]
        ) as channel:
            call = channel.unary_unary(
                "/kvserver.v1.KVServer/ScoreHosts",
                request_serializer=pb.ScoreHostsRequest.SerializeToString,
                response_deserializer=pb.ScoreHostsResponse.FromString,
            )
            metadata = (("authorization", f"Bearer {d.token}"),)

            def refused(match: str, **fields: Any) -> None:
                req = pb.ScoreHostsRequest(namespace_id=ns_id, keys=pb.KeyPrefix(keys=keys))
                for name, value in fields.items():
                    field = getattr(req, name)
                    (field.update if name == "tier_weights" else field.extend)(value)
                with pytest.raises(grpc.RpcError) as info:
                    call(req, metadata=metadata, timeout=60)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert match in (info.value.details() or ""), info.value.details()

            Path(f"/proc/{d.proc.pid}/clear_refs").write_text("5")  # the peak := RSS now
            before = rss(d.proc.pid)
            refused("candidate_hosts", candidate_hosts=[str(i) for i in range(1_500_000)])
            peak = rss(d.proc.pid, "VmHWM") - before
            assert peak < 150 * MIB, peak
            refused("tier_weights", tier_weights={f"tier-{i}": 1.0 for i in range(350_000)})
            for bad in (math.nan, math.inf, -1.0, 1e7):
                refused("tier weight must be in [0, 1e6]", tier_weights={"dram": bad})
            refused("unknown tier", tier_weights={"gpu": 1.0})
            req = pb.ScoreHostsRequest(namespace_id=ns_id, keys=pb.KeyPrefix(keys=keys))
            req.candidate_hosts.extend(["a"] * 4092 + ["b"] * 4)  # within the bound
            reply = call(req, metadata=metadata, timeout=60)
            assert [h.host_id for h in reply.hosts] == ["a"]
        with KVClient(d.zmq_address) as kv:
            assert kv.hello()["protocol_version"] > 0
    finally:
        d.kill()
