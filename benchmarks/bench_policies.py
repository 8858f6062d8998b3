"""Benchmark: hit rate of each eviction policy vs Belady's MIN, with prefix semantics.

Usage: ``python benchmarks/bench_policies.py [--quick] [--json FILE] [--seed N]``

Runs in one process, no daemon, no I/O besides the results. A trace is a sequence of requests,
each a prefix chain of chunk keys (a chunk = one DRAM entry, e.g. 256 tokens; all chunks cost
1), replayed the way the engine serves them:

- a request's hits are its leading run of resident chunks: the first miss ends them, even if
  later chunks are resident (prefix semantics); the hits are touched (``touch(hits)``, head
  first, as a planning lookup does);
- its missing chunks are then stored as one batch: ``evict(need)`` frees what the cache lacks,
  never choosing one of the request's own chunks, then ``insert_batch(missing)`` in request
  order (the engine's ``make_ready``). A store whose chunks cannot fit is refused (as
  ``prepare_store`` returning None): nothing is stored.

Traces (sizes in chunks; each a mix of the same generator with different parameters):

- ``chat``: multi-turn chats: every conversation starts from one of a few shared system prompts
  (Zipf popularity); turn t re-reads the conversation's whole prefix and appends its new chunks.
  A fixed number of conversations is live at once, their turns interleaved at random; long
  one-off documents (a system prompt, then never-reused chunks) on 1 % of requests;
- ``system``: many short conversations (1-3 turns) over 48 shared system prompts, no documents:
  reuse across conversations dominates;
- ``scan``: ``chat`` with documents on 5 % of requests: the scans that pollute a recency cache.

The reference is Belady's MIN under the same rules: on a store it evicts the resident chunks
whose next use (the index of the next request that reads them) is farthest, the deepest first
on ties (an ancestor is always read with its descendants, so this keeps the cache
prefix-closed). It is the classic offline optimum of demand paging, not a proven optimum of
prefix semantics; every policy here scored at or below it. Budgets are fractions of the trace's
distinct-chunk count.

Output: a table per trace, a JSON file (default benchmarks/results/policies.json), a PNG plot
beside it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvserver.policies import POLICIES, make_policy

BUDGETS = (0.02, 0.05, 0.10, 0.20, 0.40)

Trace = list[list[int]]  # requests, each a chain of chunk keys


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Parameters of one synthetic trace (all sizes in chunks)."""

    seed: int = 0
    num_conversations: int = 500
    num_live: int = 128  # conversations interleaved at any moment (sessions of one host)
    num_system_prompts: int = 12
    system_prompt_chunks: tuple[int, int] = (32, 128)
    zipf_s: float = 1.1  # popularity of system prompt i ~ 1 / (i + 1) ** s
    turns: tuple[int, int] = (2, 10)
    turn_chunks: tuple[int, int] = (1, 16)
    doc_probability: float = 0.01  # per request: a one-off document instead of a chat turn
    doc_chunks: tuple[int, int] = (200, 2000)


TRACES: dict[str, TraceConfig] = {
    "chat": TraceConfig(),
    "system": TraceConfig(
        num_conversations=2000,
        num_live=64,
        num_system_prompts=48,
        system_prompt_chunks=(16, 96),
        turns=(1, 3),
        doc_probability=0.0,
    ),
    "scan": TraceConfig(doc_probability=0.05),
}


def generate_trace(cfg: TraceConfig) -> Trace:
    """The requests: integer chunk keys, new keys numbered as they appear."""
    rng = random.Random(cfg.seed)
    requests: Trace = []
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
            requests.append(system_prompt() + fresh(rng.randint(*cfg.doc_chunks)))
            continue
        i = rng.randrange(len(live))
        prefix, turns_left = live[i]
        prefix.extend(fresh(rng.randint(*cfg.turn_chunks)))
        requests.append(list(prefix))
        turns_left[0] -= 1
        if turns_left[0] == 0:
            live[i] = live[-1]
            live.pop()
    return requests


def _unit(_key: Hashable) -> int:
    return 1


def _outside(own: set[int]) -> Callable[[Hashable], bool]:
    """``evictable`` for a store: the request's own chunks are not."""
    return lambda key: key not in own


def leading_hits(keys: Sequence[int], resident: Any) -> int:
    hits = 0
    for key in keys:
        if key not in resident:
            break
        hits += 1
    return hits


def replay_policy(name: str, trace: Trace, capacity: int) -> int:
    """Replay through a ``capacity``-chunk cache run by policy ``name``; the hit count."""
    policy = make_policy(name)
    touch, insert_batch, evict = policy.touch, policy.insert_batch, policy.evict
    hits = size = 0
    for keys in trace:
        n = leading_hits(keys, policy)
        hits += n
        if n:
            touch(keys[:n])
        missing = [key for key in keys[n:] if key not in policy]
        if not missing:
            continue
        need = size + len(missing) - capacity
        if need > 0:
            victims = evict(need, _unit, _outside(set(keys)))
            if victims is None:
                continue  # refused store: nothing stored
            size -= len(victims)
        insert_batch(missing)
        size += len(missing)
    return hits


def next_uses(trace: Trace) -> list[list[int]]:
    """next_use[r][i] = index of the next request reading trace[r][i], len(trace) if none."""
    n = len(trace)
    result: list[list[int]] = [[]] * n
    last: dict[int, int] = {}
    for r in range(n - 1, -1, -1):
        keys = trace[r]
        result[r] = [last.get(key, n) for key in keys]
        for key in keys:
            last[key] = r
    return result


def replay_belady(trace: Trace, nxt: list[list[int]], capacity: int) -> int:
    """Belady's MIN under the rules of replay_policy: a max-heap on (next use, depth) with lazy
    invalidation (an entry is live iff its next use still matches ``resident[key]``)."""
    resident: dict[int, int] = {}  # key -> index of its next use
    depth: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, key)
    hits = 0
    for keys, uses in zip(trace, nxt, strict=True):
        hits += leading_hits(keys, resident)
        missing: list[tuple[int, int]] = []
        for i, key in enumerate(keys):
            if key in resident:
                resident[key] = uses[i]
                heapq.heappush(heap, (-uses[i], -i, key))
            else:
                missing.append((i, key))
        need = len(resident) + len(missing) - capacity
        if need > 0:
            own = set(keys)
            skipped: list[tuple[int, int, int]] = []
            victims: list[tuple[int, int, int]] = []
            while len(victims) < need and heap:
                entry = heapq.heappop(heap)
                if resident.get(entry[2]) != -entry[0]:
                    continue  # stale
                (skipped if entry[2] in own else victims).append(entry)
            for entry in skipped + (victims if len(victims) < need else []):
                heapq.heappush(heap, entry)
            if len(victims) < need:
                continue  # refused store
            for entry in victims:
                del resident[entry[2]], depth[entry[2]]
        for i, key in missing:
            resident[key] = uses[i]
            depth[key] = i
            heapq.heappush(heap, (-uses[i], -i, key))
        if len(heap) > 4 * capacity + 1024:
            heap = [(-use, -depth[key], key) for key, use in resident.items()]
            heapq.heapify(heap)
    return hits


def run_trace(cfg: TraceConfig, budgets: Sequence[float], bar: tqdm[Any]) -> dict[str, Any]:
    """Replay one trace through every policy and Belady at every budget."""
    t0 = time.perf_counter()
    trace = generate_trace(cfg)
    nxt = next_uses(trace)
    num_accesses = sum(map(len, trace))
    num_distinct = len({key for keys in trace for key in keys})
    capacities = {b: max(1, round(b * num_distinct)) for b in budgets}
    rates: dict[str, dict[str, float]] = {}
    for budget, capacity in capacities.items():
        label = f"{budget:.0%}"
        row = rates[label] = {}
        bar.set_postfix_str(f"belady@{label}")
        row["belady"] = replay_belady(trace, nxt, capacity) / num_accesses
        bar.update()
        for name in sorted(POLICIES):
            bar.set_postfix_str(f"{name}@{label}")
            row[name] = replay_policy(name, trace, capacity) / num_accesses
            bar.update()
    return {
        "config": asdict(cfg),
        "num_requests": len(trace),
        "num_accesses": num_accesses,
        "num_distinct_chunks": num_distinct,
        "max_hit_rate": 1 - num_distinct / num_accesses,
        "budgets": {f"{b:.0%}": c for b, c in capacities.items()},
        "hit_rates": rates,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def gap_closed(rates: dict[str, float], name: str, baseline: str = "arc") -> float | None:
    """Share of the baseline→Belady gap that policy ``name`` closes (None without a gap)."""
    gap = rates["belady"] - rates[baseline]
    return (rates[name] - rates[baseline]) / gap if gap > 1e-9 else None


def run(configs: dict[str, TraceConfig], budgets: Sequence[float]) -> dict[str, Any]:
    """Every trace; results flattened as name@trace@budget rows with Belady as reference."""
    names = sorted(POLICIES)
    traces: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    with tqdm(
        total=len(configs) * len(budgets) * (len(names) + 1),
        desc="replay",
        unit="run",
        disable=not sys.stderr.isatty(),
    ) as bar:
        for trace_name, cfg in configs.items():
            info = traces[trace_name] = run_trace(cfg, budgets, bar)
            for label, rates in info["hit_rates"].items():
                ref = rates["belady"]
                for name in names:
                    closed = gap_closed(rates, name)
                    results.append(
                        {
                            "name": f"{name}@{trace_name}@{label}",
                            "value": rates[name],
                            "unit": "hit_rate",
                            "reference": ref,
                            "ratio": rates[name] / ref if ref else 0.0,
                            "arc_gap_closed": closed,
                        }
                    )
    return {"traces": traces, "results": results}


def print_table(report: dict[str, Any]) -> None:
    names = sorted(POLICIES)
    for trace_name, info in report["traces"].items():
        print(
            f"\n{trace_name}: {info['num_requests']:,} requests, {info['num_accesses']:,} "
            f"chunk reads, {info['num_distinct_chunks']:,} distinct chunks, max possible hit "
            f"rate {info['max_hit_rate']:.3f}, {info['seconds']} s"
        )
        header = f"{'budget':>7} {'chunks':>8} {'belady':>7}"
        header += "".join(f" {name:>7} {'/opt':>5}" for name in names)
        print(header + "  gap ARC->opt closed by: " + ", ".join(n for n in names if n != "arc"))
        for label, capacity in info["budgets"].items():
            rates = info["hit_rates"][label]
            row = f"{label:>7} {capacity:>8,} {rates['belady']:>7.3f}"
            for name in names:
                row += f" {rates[name]:>7.3f} {rates[name] / rates['belady']:>5.2f}"
            closed = [gap_closed(rates, n) for n in names if n != "arc"]
            row += "  " + ", ".join("-" if c is None else f"{c:+.0%}" for c in closed)
            print(row)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = report["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, (trace_name, info) in zip(axes[0], traces.items(), strict=True):
        labels = list(info["budgets"])
        xs = [float(label.rstrip("%")) for label in labels]
        rates = info["hit_rates"]
        ax.plot(xs, [rates[b]["belady"] for b in labels], "k--", marker="o", label="belady")
        for name in sorted(POLICIES):
            ax.plot(xs, [rates[b][name] for b in labels], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("DRAM budget (% of distinct chunks)")
        ax.set_ylabel("hit rate (prefix semantics)")
        ax.set_title(trace_name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small traces (< 1 min)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/policies.json"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configs = {name: replace(cfg, seed=args.seed) for name, cfg in TRACES.items()}
    if args.quick:
        configs = {
            name: replace(cfg, num_conversations=cfg.num_conversations // 4)
            for name, cfg in configs.items()
        }
    report = run(configs, BUDGETS)
    report["quick"] = args.quick
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    png = args.json.with_suffix(".png")
    plot(report, png)
    print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
