"""``chain`` under clients that never look anything up (a plain put/get client, gRPC): through
the real storage engine, its admission declines nothing it has no evidence to decline.

Such a client shows the policy stores and loads only. Before issue 15 item 1's fix a load was
no return, so every put's state learnt p near 0 from evictions alone and admission declined
about half of what the client put (docs/benchmarks.md, "Eviction policies vs Belady").
"""

from __future__ import annotations

import hashlib
import random

from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.namespace import NamespaceSpec

PART = 64 << 10


def make_engine(policy: str, capacity: int) -> tuple[StorageEngine, str]:
    engine = StorageEngine(EngineConfig(dram_bytes=capacity * PART, page_size=PART, policy=policy))
    spec = NamespaceSpec(
        model="test/plain-clients", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
        block_size=16, part_bytes_override=PART,
    )  # fmt: skip
    return engine, engine.register_namespace(spec)


def put(engine: StorageEngine, ns: str, keys: list[bytes]) -> list[bytes]:
    """A plain client's put of ``keys`` (one store, no lookup); the keys not admitted."""
    grant = engine.prepare_store(ns, keys)
    assert grant is not None
    for key in grant.keys:
        engine.write_part(grant.lease_id, key, 0, bytes(PART))
    if grant.keys:
        engine.complete_store(grant.lease_id)
    return list(grant.filtered)


def get(engine: StorageEngine, ns: str, keys: list[bytes]) -> int:
    """A plain client's get: the resident keys are loaded; how many."""
    missing = set(engine.missing(ns, keys))
    present = [key for key in keys if key not in missing]
    if present:
        engine.complete_load(engine.prepare_load(ns, present).lease_id)
    return len(present)


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def test_a_large_put_after_a_put_read_back_is_stored_whole() -> None:
    """test_client's large put, reduced to the engine: 96 chunks; a 35-chunk put as windows
    of 16 + 16 + 3 read back, a 32-chunk put, then another 35-chunk put in windows: every
    window is stored. Before: the second put's windows evicted the first's 3-chunk window,
    one outcome (not returned) that put 3-chunk first turns a hair below the rest, and the
    last window (3 new chunks) was declined on a 0.08 log-odds margin."""
    engine, ns = make_engine("chain", 96)
    with engine:
        first = keys_of("first", 35)
        for window in (first[:16], first[16:32], first[32:]):
            assert put(engine, ns, window) == []
        assert get(engine, ns, first) == 35
        second = keys_of("second", 32)
        for window in (second[:16], second[16:]):
            assert put(engine, ns, window) == []
        third = keys_of("third", 35)
        for window in (third[:16], third[16:32], third[32:]):
            assert put(engine, ns, window) == []
        assert get(engine, ns, third) == 35


def replay_put_get(policy: str, seed: int, capacity: int) -> tuple[int, int]:
    """benchmarks/policy_putget.py's plain workload, shorter: 40 % puts of 1-40 new chunks,
    60 % gets of a whole earlier put (recent ones most). (chunks not admitted, chunks got)."""
    rng = random.Random(seed)
    engine, ns = make_engine(policy, capacity)
    puts: list[list[bytes]] = []
    declined = got = 0
    with engine:
        for op in range(1500):
            if puts and rng.random() < 0.6:
                back = min(int(rng.expovariate(1 / 30)), len(puts) - 1)
                got += get(engine, ns, puts[-1 - back])
                continue
            keys = keys_of(f"{seed}/{op}", rng.randint(1, 40))
            declined += len(put(engine, ns, keys))
            puts.append(keys)
    return declined, got


def test_chain_declines_nothing_a_plain_client_puts_and_hits_as_often_as_prefix() -> None:
    """A client that never looks anything up: its gets are its puts' returns, its puts learn
    that they are read back, and ``chain`` declines none of them; its gets hit at least as
    many chunks as under ``prefix`` (the default before ``chain``). Before: 40-50 % of the
    chunks put were declined and the gets hit half as often."""
    for seed in (0, 1):
        declined, got = replay_put_get("chain", seed, 256)
        _, got_prefix = replay_put_get("prefix", seed, 256)
        assert declined == 0
        assert got >= got_prefix
