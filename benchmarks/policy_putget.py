"""Probe: each DRAM policy under plain put/get clients (no conversation structure), through the
real storage engine: how many chunks an admitting policy (``chain``) declines, and the gets'
hit rate.

Usage::

    PYTHONPATH=TREE python -m benchmarks.policy_putget [--capacity 256] [--seeds 3]

The workload (per seed, 4,000 operations on a DRAM tier of ``--capacity`` chunks of one
64 KiB part): 40 % puts of 1-40 new chunks (uniform), 60 % gets of one whole earlier put,
chosen ``1 + Exp(mean 30)`` puts back (recent puts are read most). A get reads the chunks that
are resident (``prepare_load`` + ``complete_load``) and counts them as hits. Two variants: plain
(``put``/``get`` as a KV client uses them: the policy sees stores and load touches only), and
with a touching lookup of the put's keys before each operation (``lookup(touch=True)``, as the
scheduler connector's planning lookups do). A get re-reads the same keys: for ``chain`` that
is the same request again (its tail is the chain's tail), never a chain's return.

Prints per policy and variant the chunks stored, the chunks not admitted (``filtered``: only an
admitting policy declines) and the gets' hit rate (mean over the seeds). Deterministic; seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import random

from kvserver.engine import StorageEngine
from kvserver.engine.types import EngineConfig
from kvserver.namespace import NamespaceSpec

POLICIES = ("lru", "prefix", "chain")
OPERATIONS = 4000
PART_BYTES = 64 << 10
GET_SHARE = 0.6
MAX_PUT = 40
MEAN_BACK = 30.0


def replay(policy: str, seed: int, capacity: int, lookups: bool) -> tuple[int, int, int, int]:
    """One seed's workload; (chunks stored, chunks filtered, chunks got, chunks asked)."""
    rng = random.Random(seed)
    config = EngineConfig(dram_bytes=capacity * PART_BYTES, page_size=PART_BYTES, policy=policy)
    spec = NamespaceSpec(
        model="probe/putget", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
        block_size=16, part_bytes_override=PART_BYTES,
    )  # fmt: skip
    payload = bytes(PART_BYTES)
    puts: list[list[bytes]] = []
    stored = filtered = got = asked = 0
    with StorageEngine(config) as engine:
        ns = engine.register_namespace(spec)
        for op in range(OPERATIONS):
            if puts and rng.random() < GET_SHARE:
                keys = puts[-1 - min(int(rng.expovariate(1 / MEAN_BACK)), len(puts) - 1)]
                if lookups:
                    engine.lookup(ns, keys, touch=True)
                missing = set(engine.missing(ns, keys))
                present = [k for k in keys if k not in missing]
                asked += len(keys)
                got += len(present)
                if present:
                    engine.complete_load(engine.prepare_load(ns, present).lease_id)
                continue
            n = rng.randint(1, MAX_PUT)
            keys = [hashlib.sha256(f"{seed}/{op}/{i}".encode()).digest() for i in range(n)]
            if lookups:
                engine.lookup(ns, keys, touch=True)
            grant = engine.prepare_store(ns, keys)
            if grant is None:  # every page pinned or reserved: cannot happen here
                continue
            filtered += len(grant.filtered)
            stored += len(grant.keys)
            for key in grant.keys:
                engine.write_part(grant.lease_id, key, 0, payload)
            if grant.keys:
                engine.complete_store(grant.lease_id)
            puts.append(keys)
    return stored, filtered, got, asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, default=256, help="DRAM chunks (default 256)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    args = parser.parse_args()
    for lookups in (False, True):
        for policy in POLICIES:
            runs = [replay(policy, s, args.capacity, lookups) for s in range(args.seeds)]
            rate = sum(g / max(a, 1) for _, _, g, a in runs) / len(runs)
            print(
                f"{'touching lookups' if lookups else 'plain put/get':16s} {policy:6s} "
                f"stored {sum(r[0] for r in runs):6d}  filtered {sum(r[1] for r in runs):6d}  "
                f"get hit rate {rate:.3f}"
            )


if __name__ == "__main__":
    main()
