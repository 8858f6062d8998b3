"""Instructions per chunk operation of eviction policies replaying one ``bench_policies`` trace,
counted by callgrind (deterministic: the load of a shared machine does not move them).

Usage (PYTHONPATH selects the tree measured; to measure an older tree, copy this file into its
benchmarks/ first)::

    PYTHONPATH=TREE python -m benchmarks.policy_instructions [--trace system] [--budget 0.05]
        [--seed 0] [--policies lru chain]

One process under callgrind: the trace is generated, then each policy replays it
(``bench_policies.replay_policy``, the replay's own bookkeeping included, the same for every
policy) between two ``callgrind_control --dump``; a chunk operation is a key touched, inserted
or evicted. Prints instructions per chunk operation and the ratio to the first policy. Needs
valgrind; about a minute per policy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.bench_policies import _Counting, replay_policy
from benchmarks.harness.callgrind import dump, dump_name, per_call, run_measured
from benchmarks.policy_traces import TRACES_ALL, generate_trace
from kvserver.policies import make_policy


def measured(trace_name: str, budget: float, seed: int, policies: list[str], out: Path) -> None:
    """Replay under callgrind, one dump per policy named by its index and chunk operations."""
    trace = generate_trace(replace(TRACES_ALL[trace_name], seed=seed))
    capacity = max(1, round(budget * len({key for keys in trace for key in keys})))
    dump(out, "warm-up")
    for index, name in enumerate(policies):
        count = _Counting()
        replay_policy(make_policy(name), trace, capacity, count)
        dump(out, dump_name(index, count.ops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", default="system", choices=sorted(TRACES_ALL))
    parser.add_argument("--budget", type=float, default=0.05, help="of the distinct chunks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["lru", "chain"])
    parser.add_argument("--out", type=Path, help="callgrind files here (default: a temp dir)")
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserver-callgrind-"))
    if args.measured:
        measured(args.trace, args.budget, args.seed, args.policies, out)
        return
    run_measured(out, "replay", "benchmarks.policy_instructions", [
        "--measured",
        "--trace", args.trace, "--budget", str(args.budget), "--seed", str(args.seed),
        "--policies", *args.policies, "--out", str(out),
    ])  # fmt: skip
    print(f"tree: {os.environ.get('PYTHONPATH', '(installed)')}; {args.trace} seed {args.seed} "
          f"at {args.budget:.0%}; callgrind files in {out}")  # fmt: skip
    counts = per_call(out, "replay.*.*", args.policies)
    first = counts[args.policies[0]]
    for name, ir in counts.items():
        print(f"{name:8s} {ir:9.0f} instructions/chunk op  {ir / first:5.2f}x {args.policies[0]}")


if __name__ == "__main__":
    main()
