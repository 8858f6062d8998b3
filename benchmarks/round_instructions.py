"""Instructions per step of the bench's co-located round run in-process on the storage engine
(no daemon, no sockets), per eviction policy: what each policy costs the round's four engine
calls with DRAM full, counted by callgrind (deterministic: the load of a shared machine does
not move them).

Usage (PYTHONPATH selects the tree measured; to measure an older tree, copy this file into its
benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.round_instructions [--policies prefix chain lru]
        [--chunks 256] [--reps 20]
    PYTHONPATH=TREE python -m benchmarks.round_instructions --wall     # no valgrind: µs/step
    PYTHONPATH=TREE python -m benchmarks.round_instructions --wall --cold

The geometry is the bench's (``bench_daemon``, ``colocated_instructions``): DRAM 256 MiB of
64 KiB pages, chunks of one 256 KiB part, 256 new keys per batch (64 MiB), so after the warm-up
every ``prepare_store`` evicts the batch stored four rounds before, which its round loaded. A
round is ``prepare_store``, ``complete_store`` (the whole lease), ``prepare_load`` and
``complete_load`` of the batch, as ``bench_daemon._colocated_round`` asks them of the daemon;
``callgrind_control --dump`` after each step of ``--reps`` rounds, and a step's figure is the
mean of its dumps less an empty step's (two dumps back to back: what a dump itself costs).
One process per policy. Prints
instructions per step and per chunk. Needs valgrind; ~1 minute per policy.

``--wall --cold`` copies 96 MiB (more than this machine's 32 MiB L3) before every step, as the
bench's client does between the daemon's requests (64 MiB of parts written, then read): the
engine then finds none of its dicts and records in the caches, and its time per step is what
the daemon's requests cost in the bench, where the warm figure is what instructions alone cost.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness.callgrind import dump, dump_name, run_measured

STEPS = ("prepare_store", "complete_store", "prepare_load", "complete_load")
PART_BYTES = 256 << 10
DRAM_BYTES = 256 << 20
WARMUP_ROUNDS = 8
#: what ``--cold`` copies before each step: more than the last-level cache (32 MiB here)
COLD_BYTES = 96 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["prefix", "chain", "lru"])
    parser.add_argument("--chunks", type=int, default=256, help="keys per batch (default 256)")
    parser.add_argument("--reps", type=int, default=20, help="measured rounds (default 20)")
    parser.add_argument("--wall", action="store_true", help="no valgrind: wall µs per step")
    parser.add_argument("--cold", action="store_true",
                        help=f"with --wall: copy {COLD_BYTES >> 20} MiB before each step (caches "
                             "flushed, as the bench's copies do)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1 or not 0 < args.chunks * PART_BYTES <= DRAM_BYTES // 2:
        parser.error("--reps must be >= 1 and --chunks * 256 KiB at most half of 256 MiB")
    if args.cold and not args.wall:
        parser.error("--cold needs --wall (under callgrind a cache miss costs no instruction)")
    if args.wall:
        for policy in args.policies:
            seconds = run_rounds(policy, args.chunks, args.reps, None, cold=args.cold)
            row = "  ".join(f"{s} {seconds[s] / args.reps * 1e6:8.1f}" for s in STEPS)
            total = sum(seconds.values()) / args.reps * 1e6
            print(f"{policy:8s} µs/step{' (cold)' if args.cold else ''}: {row}  round {total:8.1f}")
        return
    base = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    if args.measured:
        run_rounds(args.policies[0], args.chunks, args.reps, base)
        return
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; {args.chunks} chunks of "
          f"256 KiB per batch; callgrind files in {base}")  # fmt: skip
    for policy in args.policies:
        out = base / policy
        run_measured(out, "round", "benchmarks.round_instructions", [
            "--measured", "--policies", policy, "--chunks", str(args.chunks),
            "--reps", str(args.reps), "--out", str(out),
        ])  # fmt: skip
        *counts, empty = step_means(out, len(STEPS) + 1)
        net = [ir - empty for ir in counts]
        row = "  ".join(f"{s} {ir / 1e6:6.3f} M ({ir / args.chunks / 1e3:5.1f} k)"
                        for s, ir in zip(STEPS, net, strict=True))  # fmt: skip
        print(f"{policy:8s} {row}")


def run_rounds(
    policy: str, chunks: int, reps: int, out: Path | None, *, cold: bool = False
) -> dict[str, float]:
    """Warm up, then run ``reps`` rounds, with ``out`` (under callgrind) a dump after each step
    and an empty one after each round (what a dump costs); returns the wall seconds per step
    (summed over the rounds). ``cold``: :data:`COLD_BYTES` copied before each step, untimed."""
    from kvserver.daemon.service import KVService
    from kvserver.engine.types import EngineConfig
    from kvserver.namespace import NamespaceSpec

    spec = NamespaceSpec(
        model="bench/round-instructions", dtype="uint8", num_layers=1, num_kv_heads=1,
        head_dim=1, block_size=16, part_bytes_override=PART_BYTES,
    )  # fmt: skip
    service = KVService(EngineConfig(dram_bytes=DRAM_BYTES, policy=policy))
    engine = service.engine
    ns_id = service.register_namespace(spec)["ns_id"]
    batches = iter(range(1 << 30))

    def new_keys() -> list[bytes]:
        b = next(batches)
        return [f"{b}-{i}".encode().ljust(32, b".") for i in range(chunks)]

    seconds = dict.fromkeys(STEPS, 0.0)
    keys: list[bytes] = []
    leases = [0, 0]  # the round's store lease, load lease

    def prepare_store() -> None:
        grant = engine.prepare_store(ns_id, keys, client="bench")
        assert grant is not None and len(grant.keys) == chunks, "not every key granted"
        leases[0] = grant.lease_id

    def complete_store() -> None:
        engine.complete_store(leases[0])

    def prepare_load() -> None:
        leases[1] = engine.prepare_load(ns_id, keys, client="bench").lease_id

    def complete_load() -> None:
        engine.complete_load(leases[1])

    steps = (prepare_store, complete_store, prepare_load, complete_load)
    flush = cold_flush(COLD_BYTES) if cold else None
    for _ in range(WARMUP_ROUNDS):
        keys[:] = new_keys()
        for fn in steps:
            fn()
    dump(out, "warm-up")
    for _ in range(reps):
        keys[:] = new_keys()
        for index, fn in enumerate(steps):
            if flush is not None:
                flush()
            start = time.perf_counter()
            fn()
            seconds[STEPS[index]] += time.perf_counter() - start
            dump(out, dump_name(index, 1))
        dump(out, dump_name(len(STEPS), 1))  # an empty step: what a dump itself costs
    service.close()
    return seconds


def cold_flush(nbytes: int) -> Callable[[], None]:
    """A call that copies ``nbytes`` (evicting what the caches held, as the bench's copies do
    between the daemon's requests)."""
    source, target = bytes(nbytes), bytearray(nbytes)

    def flush() -> None:
        target[:] = source

    return flush


def step_means(out: Path, kinds: int) -> list[float]:
    """Mean instructions per dump of each kind ``0 .. kinds - 1`` in ``out`` (every dump of a
    kind, which :func:`~benchmarks.harness.callgrind.per_call` would keep one of)."""
    sums, counts = [0.0] * kinds, [0] * kinds
    for path in out.glob("round.*.*"):
        text = path.read_text(errors="replace")[:4096]
        trigger = re.search(r"^desc: Trigger: .*kind(\d+)x1\s*$", text, re.M)
        total = re.search(r"^summary: (\d+)$", text, re.M)
        if trigger is None or total is None:
            continue
        sums[int(trigger.group(1))] += int(total.group(1))
        counts[int(trigger.group(1))] += 1
    if not all(counts):
        raise SystemExit(f"callgrind dumps missing in {out}: {counts}")
    return [total / n for total, n in zip(sums, counts, strict=True)]


if __name__ == "__main__":
    main()
