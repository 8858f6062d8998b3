"""Benchmark: hit rate of each eviction policy vs Belady's MIN, with prefix semantics.

Usage: ``python -m benchmarks.bench_policies [--quick] [--json FILE] [--seeds N ...]
[--traces NAME ...]``

Runs in one process, no daemon, no I/O besides the results. A trace is a sequence of requests,
each a prefix chain of chunk keys (a chunk = one DRAM entry, e.g. 256 tokens; all chunks cost
1), replayed the way the engine serves them:

- a request's hits are its leading run of resident chunks: the first miss ends them, even if
  later chunks are resident (prefix semantics); the policy is told as a planning lookup
  tells it (``lookup(keys, hits)``: the hits touched head first, the whole chain to a policy
  that reads requests);
- its missing chunks are then stored as one batch: ``evict(need, ..., incoming=missing)``
  frees what the cache lacks, never choosing one of the request's own chunks, then
  ``insert_batch(missing)`` in request order (the engine's ``make_ready``). A store whose
  chunks cannot fit, or that a policy which ``admits`` declines, is refused (as
  ``prepare_store`` returning None): nothing is stored.

Traces (:mod:`benchmarks.policy_traces`; sizes in chunks):

- ``chat``: multi-turn chats: every conversation starts from one of 12 shared system prompts
  (Zipf popularity); turn t re-reads the conversation's whole prefix and appends its new
  chunks; long one-off documents (a system prompt, then never-reused chunks) on 1 % of
  requests;
- ``system``: many short conversations (1-3 turns) over 48 shared system prompts, no documents:
  reuse across conversations dominates;
- ``scan``: ``chat`` with documents on 5 % of requests: the scans that pollute a recency cache;
- ``*-timed``: the same with timed arrivals (heavy-tailed think time between turns) instead of
  a uniform pick among the live conversations;
- ``*-alt*``: held-out variants (other sizes, skew and mix; seeds offset by 100), never used
  to tune a policy.

References, in the same run:

- Belady's MIN under the same rules: on a store it evicts the resident chunks whose next use
  (the index of the next request that reads them) is farthest, the deepest first on ties (an
  ancestor is always read with its descendants, so this keeps the cache prefix-closed). It is
  the classic offline optimum of demand paging, not a proven optimum of prefix semantics;
  every policy here scored at or below it;
- ``dead-oracle``: the ``prefix`` policy told, after each request, which of its chunks are
  never read again (those leave first, oldest first): an online policy with a perfect
  end-of-conversation and one-off detector. What it leaves of the gap to Belady is the part
  no online signal about *whether* a chunk returns can close (only *when* it returns).

Budgets are fractions of the trace's distinct-chunk count. Hit rates are deterministic (no
timing noise); the per-operation cost of each policy (one replay each, chat at 5 %, median of
3, against LRU in the same run) is CPU time and still varies with the machine's load.

Output: a table per trace (mean over the seeds, and the share of the ARC→Belady gap closed
per seed), a JSON file (default benchmarks/results/policies.json), a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import multiprocessing
import os
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.policy_traces import (
    ALT_SEED_OFFSET,
    TRACES_ALL,
    TRACES_ALT,
    Trace,
    TraceConfig,
    generate_trace,
)
from benchmarks.report import save_report
from kvserver.policies import POLICIES, EvictionPolicy, make_policy

BUDGETS = (0.05, 0.10, 0.20)
#: the budgets issue 15's target is set at
TARGET_BUDGETS = ("5%", "10%")
ORACLE = "dead-oracle"
#: the policies whose share of the ARC->Belady gap the table prints per seed
CLOSED_BY = ("prefix", "chain")


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


class _Counting:
    """Counts the chunk operations a replay asks of a policy (touched + inserted + evicted)."""

    def __init__(self) -> None:
        self.ops = 0


def replay_policy(
    policy: EvictionPolicy, trace: Trace, capacity: int, count: _Counting | None = None
) -> int:
    """Replay through a ``capacity``-chunk cache run by ``policy``; the hit count."""
    lookup, insert_batch, evict = policy.lookup, policy.insert_batch, policy.evict
    hits = size = ops = 0
    for keys in trace:
        n = leading_hits(keys, policy)
        hits += n
        lookup(keys, n)
        missing = [key for key in keys[n:] if key not in policy]
        ops += n + len(missing)
        if not missing:
            continue
        need = size + len(missing) - capacity
        if need > 0:
            victims = evict(need, _unit, _outside(set(keys)), missing)
            if victims is None:
                continue  # refused store: nothing stored
            size -= len(victims)
            ops += len(victims)
        insert_batch(missing)
        size += len(missing)
    if count is not None:
        count.ops += ops
    return hits


def replay_dead_oracle(trace: Trace, nxt: list[list[int]], capacity: int) -> int:
    """``prefix`` told which chunks are never read again: after each request its chunks with
    no next use are marked dead; a store evicts dead chunks first (oldest mark first), then
    asks the policy for the rest. Same rules as :func:`replay_policy`."""
    policy = make_policy("prefix")
    dead: OrderedDict[int, None] = OrderedDict()
    end = len(trace)
    hits = size = 0
    for keys, uses in zip(trace, nxt, strict=True):
        n = leading_hits(keys, policy)
        hits += n
        if n:
            policy.touch(keys[:n])
        missing = [key for key in keys[n:] if key not in policy]
        need = size + len(missing) - capacity
        own = set(keys)
        if missing and need > size - sum(key in policy for key in own):
            missing = []  # refused store
        elif missing and need > 0:
            victims = [key for key in dead if key not in own][:need]
            for key in victims:
                del dead[key]
                policy.remove(key)
            rest = policy.evict(need - len(victims), _unit, _outside(own))
            assert rest is not None  # enough evictable chunks, checked above
            for victim in rest:
                dead.pop(victim, None)  # type: ignore[call-overload]  # the trace's int keys
            size -= len(victims) + len(rest)
        if missing:
            policy.insert_batch(missing)
            size += len(missing)
        for key, use in zip(keys, uses, strict=True):
            if use == end and key in policy:
                dead[key] = None
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


def run_trace(cfg: TraceConfig, budgets: Sequence[float]) -> dict[str, Any]:
    """Replay one trace (one seed) through every policy, the oracle and Belady."""
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
        row["belady"] = replay_belady(trace, nxt, capacity) / num_accesses
        row[ORACLE] = replay_dead_oracle(trace, nxt, capacity) / num_accesses
        for name in sorted(POLICIES):
            row[name] = replay_policy(make_policy(name), trace, capacity) / num_accesses
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


def op_costs(cfg: TraceConfig, budget: float = 0.05, repeats: int = 3) -> dict[str, Any]:
    """CPU time of this process per chunk operation (touched + inserted + evicted) of each
    policy replaying ``cfg`` at ``budget`` (the replay's own bookkeeping included, the same
    for every policy), median of ``repeats`` interleaved rounds, and the ratio to LRU."""
    trace = generate_trace(cfg)
    capacity = max(1, round(budget * len({key for keys in trace for key in keys})))
    per_op: dict[str, list[float]] = {name: [] for name in sorted(POLICIES)}
    for _ in range(repeats):
        for name, samples in per_op.items():
            count = _Counting()
            t0 = time.process_time()
            replay_policy(make_policy(name), trace, capacity, count)
            samples.append((time.process_time() - t0) / count.ops * 1e6)
    medians = {name: statistics.median(samples) for name, samples in per_op.items()}
    return {
        "trace": cfg.arrivals,
        "budget": f"{budget:.0%}",
        "us_per_chunk_op": medians,
        "ratio_to_lru": {name: us / medians["lru"] for name, us in medians.items()},
        "load_average": os.getloadavg(),
    }


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def summarize(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean hit rates over the seeds; the ARC→Belady gap closed per seed and its mean/min."""
    names = [*sorted(POLICIES), ORACLE]
    table: dict[str, Any] = {}
    for label in per_seed[0]["hit_rates"]:
        runs = [info["hit_rates"][label] for info in per_seed]
        row: dict[str, Any] = {
            "belady": statistics.fmean(r["belady"] for r in runs),
            **{name: statistics.fmean(r[name] for r in runs) for name in names},
        }
        for name in names:
            if name == "arc":
                continue
            closed = [gap_closed(r, name) for r in runs]
            known = [c for c in closed if c is not None]
            row[f"closed:{name}"] = {
                "per_seed": closed,
                "mean": _mean(closed),
                "min": min(known) if known else None,
            }
        table[label] = row
    return table


def run(
    configs: dict[str, TraceConfig], budgets: Sequence[float], seeds: Sequence[int], jobs: int = 1
) -> dict[str, Any]:
    """Every trace at every seed; a summary per trace and flattened name@trace@budget rows
    (mean over seeds) with Belady as the reference."""
    names = sorted(POLICIES)
    traces: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    tasks = [
        (name, seed, replace(cfg, seed=seed + (ALT_SEED_OFFSET if name in TRACES_ALT else 0)))
        for name, cfg in configs.items()
        for seed in seeds
    ]
    done: dict[tuple[str, int], dict[str, Any]] = {}
    with (
        tqdm(total=len(tasks), desc="replay", unit="trace", disable=not sys.stderr.isatty()) as bar,
        multiprocessing.get_context("spawn").Pool(jobs) as pool,
    ):
        for (name, seed, _), info in zip(
            tasks,
            pool.imap(functools.partial(run_trace, budgets=budgets), [c for _, _, c in tasks]),
            strict=True,
        ):
            done[(name, seed)] = info
            bar.update()
    for trace_name in configs:
        per_seed = [done[(trace_name, seed)] for seed in seeds]
        summary = summarize(per_seed)
        traces[trace_name] = {"seeds": list(seeds), "per_seed": per_seed, "mean": summary}
        for label, row in summary.items():
            ref = row["belady"]
            for name in [*names, ORACLE]:
                closed = row.get(f"closed:{name}", {})
                results.append(
                    {
                        "name": f"{name}@{trace_name}@{label}",
                        "value": row[name],
                        "unit": "hit_rate",
                        "reference": ref,
                        "ratio": row[name] / ref if ref else 0.0,
                        "arc_gap_closed_mean": closed.get("mean"),
                        "arc_gap_closed_min": closed.get("min"),
                    }
                )
    return {"traces": traces, "results": results}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def print_table(report: dict[str, Any]) -> None:
    names = sorted(POLICIES)
    for trace_name, info in report["traces"].items():
        first = info["per_seed"][0]
        seeds = [run["config"]["seed"] for run in info["per_seed"]]
        print(
            f"\n{trace_name}: seeds {seeds}; seed {seeds[0]}: "
            f"{first['num_requests']:,} requests, {first['num_accesses']:,} chunk reads, "
            f"{first['num_distinct_chunks']:,} distinct chunks"
        )
        header = f"{'budget':>7} {'belady':>7} {ORACLE:>11}"
        header += "".join(f" {name:>7}" for name in names)
        print(
            header
            + "   ARC->opt gap closed, per seed (mean): "
            + " | ".join(CLOSED_BY)
            + f" | {ORACLE} (mean)"
        )
        for label, row in info["mean"].items():
            line = f"{label:>7} {row['belady']:>7.3f} {row[ORACLE]:>11.3f}"
            line += "".join(f" {row[name]:>7.3f}" for name in names)
            parts = []
            for name in CLOSED_BY:
                closed = row[f"closed:{name}"]
                per_seed = " ".join(_pct(c) for c in closed["per_seed"])
                parts.append(f"{per_seed} ({_pct(closed['mean'])})")
            line += "   " + " | ".join(parts) + f" | {_pct(row[f'closed:{ORACLE}']['mean'])}"
            print(line)
    costs = report.get("op_costs")
    if costs:
        print(
            f"\nper chunk operation ({costs['trace']} chat at {costs['budget']}, load average "
            f"{costs['load_average'][0]:.1f}): "
            + ", ".join(
                f"{name} {us:.2f} us ({costs['ratio_to_lru'][name]:.2f}x LRU)"
                for name, us in costs["us_per_chunk_op"].items()
            )
        )


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = report["traces"]
    cols = min(3, len(traces))
    rows = -(-len(traces) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, (trace_name, info) in zip(axes.flat, traces.items(), strict=False):
        table = info["mean"]
        labels = list(table)
        xs = [float(label.rstrip("%")) for label in labels]
        ax.plot(xs, [table[b]["belady"] for b in labels], "k--", marker="o", label="belady")
        ax.plot(xs, [table[b][ORACLE] for b in labels], "k:", marker=".", label=ORACLE)
        for name in sorted(POLICIES):
            ax.plot(xs, [table[b][name] for b in labels], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xticks(xs, labels)
        ax.minorticks_off()
        ax.set_xlabel("DRAM budget (% of distinct chunks)")
        ax.set_ylabel(f"hit rate, mean of {len(info['seeds'])} seeds")
        ax.set_title(trace_name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(traces) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="traces a quarter the size")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/policies.json"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--traces", nargs="+", default=list(TRACES_ALL), choices=list(TRACES_ALL), metavar="NAME"
    )
    parser.add_argument("--no-op-costs", action="store_true", help="skip the per-op timing")
    parser.add_argument("--jobs", type=int, default=1, help="replay processes (one per trace)")
    args = parser.parse_args(argv)
    configs = {name: TRACES_ALL[name] for name in args.traces}
    if args.quick:
        configs = {
            name: replace(cfg, num_conversations=cfg.num_conversations // 4)
            for name, cfg in configs.items()
        }
    report = run(configs, BUDGETS, args.seeds, args.jobs)
    if not args.no_op_costs:
        report["op_costs"] = op_costs(replace(TRACES_ALL["chat"], seed=args.seeds[0]))
    report["quick"] = args.quick
    print_table(report)
    save_report(args.json, report, lambda png: plot(report, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
