"""The peer fetch of two trees, alternated: ``bench_peers.py`` run from each tree in turn
(before, after, after, before, ...), the load average recorded before each run, and the
stream fetch / raw ZMQ ratios per run and their medians per tree.

Usage::

    git -C /work/main archive HEAD | tar -x -C /tmp/before     # a tree of its own
    python benchmarks/peers_ab.py /tmp/before . --pairs 3 --parts 256KiB,1MiB --rounds 12 \\
        --out /tmp/peers_ab [--placement split]

Each run is ``python benchmarks/bench_peers.py --parts P --rounds R --runs 1 --json F``
started in the tree itself (its daemons and its bench file are the tree's own: the bench puts
its checkout first on ``sys.path`` and starts ``kvserver.cli`` from the cwd), so the trees
must both have ``benchmarks/bench_peers.py`` taking those flags. Writes every run's JSON and
``summary.json`` (the per-run rows and the medians) under ``--out``; prints the table. On a
shared machine the order matters as much as the code (the load drifts): alternate, use
several pairs, and report the spread with the medians. ``--placement`` (``same`` or ``split``;
both trees must have the flag) pins both trees' runs alike (``bench_peers.py``'s docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def order(pairs: int) -> list[str]:
    """before, after, after, before, before, after, ...: each tree as often first as second."""
    out: list[str] = []
    for i in range(pairs):
        out += ["before", "after"] if i % 2 == 0 else ["after", "before"]
    return out


def run_one(
    tree: Path, parts: str, rounds: int, json_path: Path, placement: str = "free"
) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "benchmarks/bench_peers.py", "--parts", parts,
               "--rounds", str(rounds), "--runs", "1", "--json", str(json_path)]  # fmt: skip
    if placement != "free":  # a tree from before --placement runs free only
        command += ["--placement", placement]
    if subprocess.run(command, cwd=tree, env=env, stdout=subprocess.DEVNULL).returncode:
        print(f"  {tree}: the run failed, run again once", flush=True)  # e.g. a start timed out
        subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    json_path.with_suffix(".png").unlink(missing_ok=True)  # its chart: not needed here
    report: dict[str, Any] = json.loads(json_path.read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the tree measured as 'before'")
    parser.add_argument("after", type=Path, help="the tree measured as 'after'")
    parser.add_argument("--pairs", type=int, default=3, help="runs per tree (default 3)")
    parser.add_argument("--parts", default="256KiB,1MiB", help="bench_peers --parts")
    parser.add_argument("--rounds", type=int, default=12, help="bench_peers --rounds")
    parser.add_argument("--placement", choices=("free", "same", "split"), default="free",
                        help="bench_peers --placement, the same for both trees")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="JSON files here")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rows: list[dict[str, Any]] = []
    for n, which in enumerate(order(args.pairs), 1):
        load = os.getloadavg()[0]
        path = args.out / f"{n:02d}-{which}.json"
        report = run_one(trees[which], args.parts, args.rounds, path, args.placement)
        results = report["runs"][0]["results"]
        row: dict[str, Any] = {
            "run": n, "tree": which, "load_before": load, "load_after": os.getloadavg()[0],
            "ratio": {r["part_bytes"]: r["ratio"] for r in results},
            "floor_ratio": {r["part_bytes"]: r["floor_ratio"] for r in results},
            "fetch_ms": {r["part_bytes"]: r["fetch_ms_median"] for r in results},
            "reference_ms": {r["part_bytes"]: r["reference_ms_median"] for r in results},
        }  # fmt: skip
        rows.append(row)
        cells = "  ".join(f"{p >> 10} KiB {v:.2f} (floor {row['floor_ratio'][p]:.2f})"
                          for p, v in row["ratio"].items())  # fmt: skip
        print(f"run {n:2d} {which:6s} load {load:5.2f} -> {row['load_after']:5.2f}  {cells}",
              flush=True)  # fmt: skip
    sizes = list(rows[0]["ratio"])
    medians = {
        which: {p: statistics.median(r["ratio"][p] for r in rows if r["tree"] == which)
                for p in sizes}
        for which in trees
    }  # fmt: skip
    print("stream fetch / raw ZMQ, median of runs [runs]:")
    for which in trees:
        for p in sizes:
            per = " ".join(f"{r['ratio'][p]:.2f}" for r in rows if r["tree"] == which)
            print(f"  {which:6s} {p >> 10:5d} KiB  {medians[which][p]:.2f}  [{per}]")
    summary = {"trees": {k: str(v) for k, v in trees.items()}, "parts": args.parts,
               "rounds": args.rounds, "placement": args.placement, "runs": rows,
               "medians": medians}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
