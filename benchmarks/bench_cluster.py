"""The fleet tier on Redis (docs/cluster.md): what the fleet index costs the store path, and
how fast ``ScoreHosts`` answers for a long prompt over several hosts.

1. **Store throughput, fleet index on vs off.** Two daemons with the same settings, one
   started with ``--cluster`` (a real redis-server on loopback), one standalone; one
   co-located client stores batches of chunks into each, rounds alternating between the two;
   ratio = median chunks/s with the index / without (target >= 0.9). Redis commands per
   stored chunk: ``INFO commandstats`` calls during the indexed rounds (index batches,
   heartbeats; evictions included) / chunks stored.
2. **ScoreHosts, 2,048-block prompt, 8 hosts.** Eight fleet members (``ClusterNode``s fed with
   storage events in this process, each holding a different leading run of the prompt plus
   ``--fill`` other chunks) and the indexed daemon; ``ScoreHosts`` by block hashes over gRPC,
   binary-search and exact modes, p50 / p99 (target p99 <= 5 ms). Reference in the same run:
   gRPC ``Lookup`` of the same 2,048 keys on the standalone daemon (its local index only).

Usage: python benchmarks/bench_cluster.py [--quick] [--json FILE]
With --json, also writes FILE with the .png suffix when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.daemon import RECORDED_POLICY, DaemonProc, start_daemon, wait_until
from benchmarks.harness.redis import RedisServer
from kvserver.client import KVClient
from kvserver.cluster import ClusterConfig, ClusterNode, HostInfo
from kvserver.cluster.rpc import call_score_hosts
from kvserver.eventlog import EventLog
from kvserver.events import MEDIUM_DRAM, MEDIUM_SSD, BlockStored
from kvserver.grpc_client import GrpcClient
from kvserver.namespace import NamespaceSpec

PART = 64 << 10
SPEC = NamespaceSpec(
    model="bench/cluster", dtype="float16", num_layers=16, num_kv_heads=4, head_dim=64,
    block_size=16, part_bytes_override=PART,
)  # fmt: skip
PROMPT_BLOCKS = 2048
HOSTS = 8


def commands(redis: RedisServer) -> int:
    total = 0
    for line in redis.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_") and not line.startswith("cmdstat_info"):
            total += int(line.split("calls=")[1].split(",")[0])
    return total


def store_round(kv: KVClient, ns_id: str, chunks: int, batch: int, tag: int) -> float:
    part = memoryview(bytes(PART))
    keys = [tag.to_bytes(8, "big") + i.to_bytes(8, "big") + os.urandom(16) for i in range(chunks)]
    start = time.perf_counter()
    for i in range(0, chunks, batch):
        ks = keys[i : i + batch]
        kv.store(ns_id, ks, [part] * len(ks))
    return chunks / (time.perf_counter() - start)


def bench_store(
    redis: RedisServer, on: DaemonProc, off: DaemonProc, rounds: int, chunks: int, batch: int
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"on": [], "off": []}
    with KVClient(on.zmq_address) as kv_on, KVClient(off.zmq_address) as kv_off:
        ns_on = kv_on.register_namespace(SPEC).ns_id
        ns_off = kv_off.register_namespace(SPEC).ns_id
        store_round(kv_on, ns_on, chunks, batch, 0)  # warm-up: arena pages faulted in
        store_round(kv_off, ns_off, chunks, batch, 0)
        settle(kv_on)
        before = commands(redis)
        stored = 0
        for r in range(rounds):
            rates["off"].append(store_round(kv_off, ns_off, chunks, batch, 2 * r + 1))
            rates["on"].append(store_round(kv_on, ns_on, chunks, batch, 2 * r + 2))
            stored += chunks
        settle(kv_on)
        used = commands(redis) - before
        cluster = kv_on.stats()["cluster"]
    on_rate, off_rate = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {
        "name": f"store {chunks} chunks of {PART >> 10} KiB in batches of {batch}",
        "chunks_per_s_on": on_rate,
        "chunks_per_s_off": off_rate,
        "ratio": on_rate / off_rate,
        "rounds": rates,
        "redis_commands": used,
        "commands_per_chunk": used / stored,
        "cluster": cluster,
    }


def settle(kv: KVClient) -> None:
    wait_until(lambda: kv.stats()["cluster"]["pending_keys"] == 0, timeout=60.0)
    time.sleep(0.2)  # the batch taken last is being written: let it land before counting


async def populate(url: str, ns_id: str, prompt: list[bytes], fill: int) -> None:
    """Eight members, host i holding the first (i + 1) / 8 of the prompt in DRAM, the rest of
    it on SSD for even i, and ``fill`` other chunks."""
    config = ClusterConfig(url, ttl_s=3600.0)
    nodes = []
    for i in range(HOSTS):
        log = EventLog()
        n = PROMPT_BLOCKS * (i + 1) // HOSTS
        other = [os.urandom(32) for _ in range(fill)]
        held = {(ns_id, "dram"): prompt[:n] + other}
        if i % 2 == 0:
            held[(ns_id, "ssd")] = prompt[n:]
        identity = HostInfo(f"bench-{i}", "", f"tcp://10.0.0.{i}:9471", f"10.0.0.{i}:9470")
        node = ClusterNode(config, identity, log, partial(dict, held), dict)
        await node.start()
        log.extend([BlockStored(1, ns_id, tuple(prompt[:1]), MEDIUM_DRAM)])
        if i % 2 == 0:
            log.extend([BlockStored(2, ns_id, tuple(prompt[n : n + 1]), MEDIUM_SSD)])
        assert await node.wait_written(timeout_s=60.0), node.stats()
        nodes.append(node)
    for node in nodes:  # stop writing, leave the entries (they expire after the TTL)
        node._registered = False
        await node.stop()


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": s[len(s) // 2] * 1e3,
        "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3,
    }


def bench_score(
    redis: RedisServer, on: DaemonProc, off: DaemonProc, calls: int, fill: int
) -> dict[str, Any]:
    """The reference is the standalone daemon's Lookup: the indexed one's would also ask the
    fleet (its network tier) for the keys it does not hold."""
    for d in (on, off):
        with KVClient(d.zmq_address) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
    prompt = [b"p" + i.to_bytes(4, "big") + os.urandom(27) for i in range(PROMPT_BLOCKS)]
    asyncio.run(populate(redis.url, ns_id, prompt, fill))
    out: dict[str, Any] = {"name": f"{PROMPT_BLOCKS}-block prompt, {HOSTS} hosts + 1"}
    with GrpcClient(on.grpc_address) as client, GrpcClient(off.grpc_address) as local:
        top = call_score_hosts(client, ns_id, keys=prompt)
        assert top[0].host_id == f"bench-{HOSTS - 1}" and top[0].hit_chunks == PROMPT_BLOCKS
        for name, call in (
            ("lookup_local", lambda: local.lookup_keys(ns_id, prompt)),
            ("score_hosts", lambda: call_score_hosts(client, ns_id, keys=prompt)),
            ("score_hosts_exact", lambda: call_score_hosts(client, ns_id, keys=prompt, exact=True)),
        ):
            call()
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            out[name] = percentiles(times)
    out["ratio_p99"] = out["score_hosts"]["p99_ms"] / out["lookup_local"]["p99_ms"]
    out["hosts"] = [(h.host_id, h.hit_chunks, h.tiers) for h in top]
    return out


def run(
    quick: bool, *, chunks: int = 2048, calls: int | None = None, fill: int | None = None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        d = Path(tmp)
        redis = RedisServer.start(d / "redis")
        daemons: list[DaemonProc] = []
        try:
            common = ("--dram", "512MiB", "--page-size", "64KiB", *RECORDED_POLICY)
            off = start_daemon(d / "off", *common)
            daemons.append(off)
            on = start_daemon(d / "on", *common, "--cluster", redis.url, "--host-id", "bench-on")
            daemons.append(on)
            store = bench_store(redis, on, off, rounds=3 if quick else 7, chunks=chunks, batch=64)
            calls = calls or (50 if quick else 300)
            fill = fill if fill is not None else (10_000 if quick else 100_000)
            score = bench_score(redis, on, off, calls=calls, fill=fill)
        finally:
            for p in daemons:
                p.terminate()
            redis.stop()
    return {"store": store, "score_hosts": score}


def write_plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    st = result["store"]
    a.bar(["index off", "index on"], [st["chunks_per_s_off"], st["chunks_per_s_on"]])
    a.set_ylabel("chunks/s (median)")
    a.set_title(f"store, ratio {st['ratio']:.2f}")
    sc = result["score_hosts"]
    names = ["lookup_local", "score_hosts", "score_hosts_exact"]
    b.bar(names, [sc[n]["p99_ms"] for n in names])
    b.axhline(5.0, linestyle="--", color="gray")
    b.set_ylabel("p99 ms")
    b.set_title("2,048 blocks, 8 hosts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = run(args.quick)
    st, sc = result["store"], result["score_hosts"]
    print(
        f"store with the fleet index / without: {st['ratio']:.2f} "
        f"({st['chunks_per_s_on']:.0f} vs {st['chunks_per_s_off']:.0f} chunks/s); "
        f"{st['commands_per_chunk']:.3f} Redis commands per stored chunk"
    )
    for n in ("lookup_local", "score_hosts", "score_hosts_exact"):
        print(f"{n:>18}: p50 {sc[n]['p50_ms']:.2f} ms  p99 {sc[n]['p99_ms']:.2f} ms")
    print(f"ScoreHosts p99 / local Lookup p99: {sc['ratio_p99']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
        png = args.json.with_suffix(".png")
        print(f"wrote {args.json}" + (f" and {png}" if write_plot(result, png) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
