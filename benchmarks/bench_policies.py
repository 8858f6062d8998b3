"""Benchmark: DRAM hit rate of each eviction policy vs Belady's optimum on a synthetic trace.

Usage: ``python benchmarks/bench_policies.py [--quick] [--json FILE] [--seed N]``

Runs in one process, no daemon, no I/O besides the results. The trace is a sequence of chunk
keys (a chunk = one DRAM entry, e.g. 256 tokens; all chunks cost 1):

- multi-turn chats: every conversation starts from one of a few shared system prompts (32-128
  chunks, Zipf popularity); turn t re-reads the conversation's whole prefix (system prompt +
  every earlier turn) and then appends its new chunks (user message + reply). A fixed number of
  conversations is live at once and their turns are interleaved at random;
- long one-off documents now and then (a system prompt, then 200-2000 never-reused chunks): the
  scans that pollute a recency-only cache.

Each access is replayed through a cache of ``capacity`` chunks: a resident key is a hit and is
touched; a miss is inserted, after ``evict(need=1)`` when the cache is full. The same flattened
trace goes through Belady's MIN (evict the resident key whose next use is farthest away), the
optimum of this demand-fetch model, so every ratio is <= 1. Budgets are fractions of the
trace's distinct-chunk count; since that count grows with the trace's length while the live
working set does not, the trace spans only ~6 generations of conversations (num_conversations
/ num_live), which keeps the budgets between "much too small" and "everything fits".

Output: a table, a JSON file (default benchmarks/results/policies.json), a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from array import array
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvserver.policies import POLICIES, make_policy

BUDGETS = (0.02, 0.05, 0.10, 0.20, 0.40)
STEP = 1 << 16  # accesses between progress updates


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Parameters of the synthetic trace (all sizes in chunks)."""

    seed: int = 0
    num_conversations: int = 1500
    num_live: int = 256  # conversations interleaved at any moment (sessions of one host)
    num_system_prompts: int = 12
    system_prompt_chunks: tuple[int, int] = (32, 128)
    zipf_s: float = 1.1  # popularity of system prompt i ~ 1 / (i + 1) ** s
    turns: tuple[int, int] = (2, 10)
    turn_chunks: tuple[int, int] = (1, 16)
    doc_probability: float = 0.01  # per request: a one-off document instead of a chat turn
    doc_chunks: tuple[int, int] = (200, 2000)


def generate_trace(cfg: TraceConfig) -> array[int]:
    """The flattened access sequence: integer chunk keys, new keys numbered as they appear."""
    rng = random.Random(cfg.seed)
    trace: array[int] = array("q")
    next_key = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_key
        next_key += n
        return list(range(next_key - n, next_key))

    prompts = [fresh(rng.randint(*cfg.system_prompt_chunks)) for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(cfg.num_system_prompts)]

    def system_prompt() -> list[int]:
        return rng.choices(prompts, weights)[0]

    live: list[tuple[list[int], list[int]]] = []  # (prefix, [turns left])
    started = 0
    while live or started < cfg.num_conversations:
        while len(live) < cfg.num_live and started < cfg.num_conversations:
            live.append((list(system_prompt()), [rng.randint(*cfg.turns)]))
            started += 1
        if rng.random() < cfg.doc_probability:
            trace.extend(system_prompt())
            trace.extend(fresh(rng.randint(*cfg.doc_chunks)))
            continue
        i = rng.randrange(len(live))
        prefix, turns_left = live[i]
        new = fresh(rng.randint(*cfg.turn_chunks))
        trace.extend(prefix)
        trace.extend(new)
        prefix.extend(new)
        turns_left[0] -= 1
        if turns_left[0] == 0:
            live[i] = live[-1]
            live.pop()
    return trace


def _unit(_key: Hashable) -> int:
    return 1


def _always(_key: Hashable) -> bool:
    return True


def replay_policy(name: str, trace: Sequence[int], capacity: int) -> Iterator[int]:
    """Replay through a ``capacity``-chunk cache run by policy ``name``; yields the hit count
    so far every STEP accesses (and once at the end)."""
    policy = make_policy(name)
    touch, insert, evict = policy.touch, policy.insert, policy.evict
    hits = size = 0
    for start in range(0, len(trace), STEP):
        for key in trace[start : start + STEP]:
            if key in policy:
                touch((key,))
                hits += 1
                continue
            if size >= capacity:
                victims = evict(1, _unit, _always)
                assert victims is not None
                size -= len(victims)
            insert(key)
            size += 1
        yield hits


def next_uses(trace: Sequence[int]) -> array[int]:
    """next_use[i] = index of the next access to trace[i], or len(trace) if none."""
    n = len(trace)
    result: array[int] = array("q", bytes(8 * n))
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        key = trace[i]
        result[i] = last.get(key, n)
        last[key] = i
    return result


def replay_belady(trace: Sequence[int], nxt: Sequence[int], capacity: int) -> Iterator[int]:
    """Belady's MIN with a max-heap on next use and lazy invalidation of stale heap entries
    (an entry is live iff it still matches ``resident[key]``); yields like replay_policy."""
    resident: dict[int, int] = {}  # key -> index of its next use
    heap: list[tuple[int, int]] = []  # (-next_use, key)
    hits = 0
    for start in range(0, len(trace), STEP):
        for i in range(start, min(start + STEP, len(trace))):
            key, use = trace[i], nxt[i]
            if key in resident:
                hits += 1
            elif len(resident) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg:
                        del resident[victim]
                        break
            resident[key] = use
            heapq.heappush(heap, (-use, key))
        yield hits


def run(cfg: TraceConfig, budgets: Sequence[float]) -> dict[str, Any]:
    """Generate the trace, replay it for every policy and Belady at every budget."""
    t0 = time.perf_counter()
    trace = generate_trace(cfg)
    nxt = next_uses(trace)
    num_distinct = len(set(trace))
    names = sorted(POLICIES)
    capacities = {b: max(1, round(b * num_distinct)) for b in budgets}
    steps = -(-len(trace) // STEP)
    rates: dict[tuple[str, float], float] = {}
    with tqdm(
        total=steps * len(budgets) * (len(names) + 1),
        desc="replay",
        unit="step",
        disable=not sys.stderr.isatty(),
    ) as bar:
        for budget, capacity in capacities.items():
            runs = {name: replay_policy(name, trace, capacity) for name in names}
            runs["belady"] = replay_belady(trace, nxt, capacity)
            for name, replay in runs.items():
                bar.set_postfix_str(f"{name}@{budget:.0%}")
                hits = 0
                for hits_so_far in replay:
                    hits = hits_so_far
                    bar.update()
                rates[name, budget] = hits / len(trace)
    results = []
    for budget in budgets:
        ref = rates["belady", budget]
        for name in names:
            value = rates[name, budget]
            results.append(
                {
                    "name": f"{name}@{budget:.0%}",
                    "value": value,
                    "unit": "hit_rate",
                    "reference": ref,
                    "ratio": value / ref if ref else 0.0,
                }
            )
    trace_info: dict[str, Any] = {
        **asdict(cfg),
        "num_accesses": len(trace),
        "num_distinct_chunks": num_distinct,
        "max_hit_rate": 1 - num_distinct / len(trace),
        "budgets": {f"{b:.0%}": c for b, c in capacities.items()},
        "belady": {f"{b:.0%}": rates["belady", b] for b in budgets},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return {"trace": trace_info, "results": results}


def print_table(report: dict[str, Any]) -> None:
    trace, results = report["trace"], report["results"]
    names = sorted(POLICIES)
    print(
        f"trace: {trace['num_accesses']:,} accesses, {trace['num_distinct_chunks']:,} distinct "
        f"chunks, max possible hit rate {trace['max_hit_rate']:.3f}, {trace['seconds']} s"
    )
    header = f"{'budget':>7} {'chunks':>8} {'belady':>7}"
    header += "".join(f" {name:>7} {'/opt':>5}" for name in names)
    print(header)
    by_name = {r["name"]: r for r in results}
    for label, capacity in trace["budgets"].items():
        row = f"{label:>7} {capacity:>8,} {trace['belady'][label]:>7.3f}"
        for name in names:
            r = by_name[f"{name}@{label}"]
            row += f" {r['value']:>7.3f} {r['ratio']:>5.2f}"
        print(row)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace, results = report["trace"], report["results"]
    labels = list(trace["budgets"])
    by_name = {r["name"]: r for r in results}
    xs = [float(label.rstrip("%")) for label in labels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [trace["belady"][b] for b in labels], "k--", marker="o", label="belady (opt)")
    for name in sorted(POLICIES):
        ys = [by_name[f"{name}@{label}"]["value"] for label in labels]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("DRAM budget (% of distinct chunks)")
    ax.set_ylabel("hit rate")
    ax.set_title("multi-turn chat + document scans")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small trace (< 30 s)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/policies.json"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = TraceConfig(seed=args.seed)
    if args.quick:
        cfg = replace(cfg, num_conversations=320, num_live=64)
    report = run(cfg, BUDGETS)
    report["trace"]["quick"] = args.quick
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    png = args.json.with_suffix(".png")
    plot(report, png)
    print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
