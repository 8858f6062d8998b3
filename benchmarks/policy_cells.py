"""One policy's replays of chosen cells against a recorded run's per-seed references.

Usage: ``python -m benchmarks.policy_cells [--policy NAME] [--traces NAME ...] [--budgets
5% ...] [--seeds N ...] [--jobs N] [--reference FILE] [--json FILE]``

Runs in one process pool, no daemon, no I/O besides the results. ``bench_policies`` replays
every policy, Belady and the dead-oracle over every trace (minutes); trying a variant of one
policy needs only that policy's replays, read against the references a ``bench_policies``
JSON recorded for the same trace, budget and seed (Belady, ARC and ``prefix`` do not change
when the policy does). A cell here is the replay ``bench_policies.run_trace`` runs (the same
trace, capacity and :func:`~benchmarks.bench_policies.replay_policy`), so its hit rate is
that run's to the last digit while the policy is unchanged: a system cell takes about a
second, all 81 of ``bench_policies`` about two minutes on two cores.

Output, per trace and budget: the mean hit rate, the share of the ARC→Belady gap closed (mean
and per seed), the change against the recorded figure of the same policy, and the smallest
per-seed margin over ``prefix``; seeds the reference lacks print their hit rates alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.bench_policies import BUDGETS, replay_policy
from benchmarks.policy_traces import ALT_SEED_OFFSET, TRACES_ALL, TRACES_ALT, generate_trace
from kvserver.policies import make_policy

#: the recorded run the cells are read against
REFERENCE = Path(__file__).resolve().parent / "results" / "policies.json"

Cell = tuple[str, str, str, int]  # policy, trace, budget label ("5%"), seed


def budget_label(budget: float) -> str:
    return f"{budget:.0%}"


def replay_cell(cell: Cell) -> float:
    """The hit rate of ``cell``'s policy on its trace, budget and seed (``run_trace``'s)."""
    policy, trace, label, seed = cell
    offset = ALT_SEED_OFFSET if trace in TRACES_ALT else 0
    requests = generate_trace(replace(TRACES_ALL[trace], seed=seed + offset))
    num_accesses = sum(map(len, requests))
    num_distinct = len({key for keys in requests for key in keys})
    budget = {budget_label(b): b for b in BUDGETS}[label]
    capacity = max(1, round(budget * num_distinct))
    return replay_policy(make_policy(policy), requests, capacity) / num_accesses


def recorded(reference: dict[str, Any], trace: str, label: str, seed: int) -> dict[str, float]:
    """The hit rates ``reference`` (a ``bench_policies`` JSON) holds for one replay, or {}."""
    info = reference.get("traces", {}).get(trace)
    if info is None or seed not in info["seeds"]:
        return {}
    rates: dict[str, float] = info["per_seed"][info["seeds"].index(seed)]["hit_rates"].get(
        label, {}
    )
    return rates


def summarize(
    policy: str, cells: Sequence[Cell], rates: Sequence[float], reference: dict[str, Any]
) -> list[str]:
    """One line per trace and budget (see the module docstring)."""
    by_cell: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for (_, trace, label, seed), rate in zip(cells, rates, strict=True):
        by_cell.setdefault((trace, label), []).append((seed, rate))
    lines = []
    for (trace, label), runs in by_cell.items():
        mean = statistics.fmean(rate for _, rate in runs)
        refs = [(recorded(reference, trace, label, seed), rate) for seed, rate in runs]
        if not all(ref for ref, _ in refs):
            lines.append(
                f"{trace:15s} {label:>4s} {mean:.5f}  " + " ".join(f"{r:.5f}" for _, r in runs)
            )
            continue
        closed = [(rate - ref["arc"]) / (ref["belady"] - ref["arc"]) for ref, rate in refs]
        change = statistics.fmean(rate - ref[policy] for ref, rate in refs)
        margin = min(rate - ref["prefix"] for ref, rate in refs)
        lines.append(
            f"{trace:15s} {label:>4s} {mean:.5f}  closes {statistics.fmean(closed):+6.1%} "
            f"({' / '.join(f'{c:.0%}' for c in closed)})  vs recorded {change:+.5f}  "
            f"over prefix, worst seed {margin:+.5f}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="chain")
    parser.add_argument("--traces", nargs="+", default=list(TRACES_ALL), choices=list(TRACES_ALL))
    parser.add_argument("--budgets", nargs="+", default=[budget_label(b) for b in BUDGETS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--reference", type=Path, default=REFERENCE)
    parser.add_argument("--json", type=Path, help="write {policy@trace@budget@seed: hit rate}")
    args = parser.parse_args(argv)
    reference = json.loads(args.reference.read_text()) if args.reference.exists() else {}
    cells: list[Cell] = [
        (args.policy, trace, label, seed)
        for trace in args.traces
        for label in args.budgets
        for seed in args.seeds
    ]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        rates = pool.map(replay_cell, cells)
    print("\n".join(summarize(args.policy, cells, rates, reference)))
    if args.json:
        out = {"@".join(map(str, cell)): rate for cell, rate in zip(cells, rates, strict=True)}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
