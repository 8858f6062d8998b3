"""``kvserver bench``'s gRPC ``Lookup`` latency (benchmarks/bench_daemon.py runs it).

Runs in the bench process, a client of a daemon already serving at the target. The reference
of every latency row is the 2 ms target (``daemon_report.LOOKUP_TARGET_MS``); the Health round
trip is printed as the floor. Not thread-safe.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from benchmarks.daemon_report import LOOKUP_TARGET_MS, Result

if TYPE_CHECKING:
    from benchmarks.daemon_refs import Target
    from kvserver.namespace import NamespaceSpec

#: tokens of the prompt looked up (2,048 blocks of 16)
LOOKUP_TOKENS = 32 * 1024


class Progress(Protocol):
    """The run's progress bar (bench_daemon's): a phase name, then a step per timed call."""

    def phase(self, text: str) -> None: ...

    def step(self, n: int = 1) -> None: ...


def bench_lookup(
    target: Target,
    spec: NamespaceSpec,
    lookup_iters: int,
    token_iters: int,
    progress: Progress,
    timeout_s: float,
) -> list[Result]:
    """Store a 32k-token prompt's chunks under ``spec`` in the daemon at ``target``, then time
    gRPC Lookup calls against it (``lookup_iters`` by keys and for the Health floor,
    ``token_iters`` by token ids), after up to 50 warm-up calls each. Raises RuntimeError when
    the prompt cannot be stored or a lookup hits fewer chunks than stored."""
    from kvserver.client import KVClient
    from kvserver.grpc_client import GrpcClient
    from kvserver.hashing import BlockHasher

    rng = random.Random(1)
    tokens = [rng.randrange(128_256) for _ in range(LOOKUP_TOKENS)]
    hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
    keys = [bytes(k) for k in hasher.chunk_keys(hasher.hash_blocks(tokens), spec.chunk_blocks)]
    with KVClient(target.zmq, timeout=timeout_s) as kv:
        ns_id = kv.register_namespace(spec).ns_id
        grant = kv.prepare_store(ns_id, keys)  # the whole prompt cached: the longest probe
        if grant is None:
            raise RuntimeError("cannot store the lookup prompt (DRAM too small?)")
        kv.complete_store(grant.lease_id)
    results: list[Result] = []
    with GrpcClient(target.grpc, timeout=timeout_s) as grpc:
        firsts = itertools.count(1)
        fresh = list(tokens)

        def new_prompt() -> Any:
            """A prompt nobody asked about: another first token changes every block's hash.
            The first id of one list is replaced in place: a copy of the 32k ids per call
            (``[first, *tokens[1:]]``, 0.1-0.2 ms of the bench's own work) is not timed."""
            fresh[0] = next(firsts) % 128_256
            return grpc.lookup_tokens(ns_id, fresh)

        cases: list[tuple[str, int, Callable[[], Any], int | None]] = [
            ("by 2,048 keys", lookup_iters, lambda: grpc.lookup_keys(ns_id, keys),
             len(keys)),
            ("by 32k token ids, the same prompt again (informational)", token_iters,
             lambda: grpc.lookup_tokens(ns_id, tokens), len(keys)),
            ("by 32k token ids, a new prompt each call (informational)", token_iters,
             new_prompt, 0),
            ("floor: Health.Check round trip (informational)", lookup_iters, grpc.health,
             None),
        ]  # fmt: skip
        for what, iters, call, hits in cases:
            progress.phase(f"gRPC {what.split(' (')[0]}")
            reply = call()
            if hits is not None and reply.hit_chunks != hits:
                raise RuntimeError(f"lookup hit {reply.hit_chunks} of {len(keys)} chunks")
            for _ in range(min(50, iters)):
                call()
            times_ms = []
            for _ in range(iters):
                start = time.perf_counter()
                call()
                times_ms.append((time.perf_counter() - start) * 1e3)
                progress.step()
            p50 = statistics.median(times_ms)
            p99 = _percentile(times_ms, 99)
            for label, value in (("p50", p50), ("p99", p99)):
                name = f"gRPC Lookup {what} {label} (reference: {LOOKUP_TARGET_MS:g} ms target)"
                if what.startswith("floor"):
                    name = f"gRPC {what.removeprefix('floor: ')} {label}"
                results.append(Result.of(name, value, "ms", LOOKUP_TARGET_MS))
    return results


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]
