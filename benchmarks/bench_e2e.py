"""End to end: prompt tokens computed with vs without kvserver on a multi-turn workload,
against the ideal reuse of that workload.

One kvserver daemon, two real TP worker processes (worker/model.py's tiny transformer on CPU)
and, twice, a real scheduler over them: without ``--kvserver`` and with it (prefix caching on
in both). Each run sends the same multi-turn conversation workload (benchmarks/harness/cluster.py:
``C`` conversations interleaved round-robin, each later prompt = previous prompt + its output +
new user tokens) one request at a time, over a GPU block pool too small to keep the earlier
turns of the other conversations, and collects every request's prompt-token sources from
Generate's usage (GPU prefix cache / kvserver / computed).

Ideal reuse: for each prompt, the longest prefix in full chunks (at most ``len - 1`` tokens)
shared with any earlier request's prompt + output: the tokens an infinite cache could skip.
Fraction of ideal reuse achieved = (prompt tokens - computed) / ideal reusable. The last
output token of a turn is sampled but never run through the model, so no cache can hold its
KV: a second, achievable ideal counts only earlier tokens whose KV was computed (prompt +
output minus its last token); the gap between the two is that one block boundary per turn.

Usage: python benchmarks/bench_e2e.py [--quick] [--json benchmarks/results/e2e.json]
Writes the JSON ({"meta", "results": [{name, value, unit, reference, ratio}]}) and a PNG with
the same stem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from tqdm import tqdm

from benchmarks.harness.cluster import (
    Workload,
    WorkloadResult,
    ideal_reusable,
    run_workload,
    start_tp_workers,
)
from benchmarks.harness.daemon import RECORDED_POLICY, start_daemon
from benchmarks.harness.procs import Proc, start_scheduler

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Setup:
    workload: Workload
    num_gpu_blocks: int


FULL = Setup(Workload(conversations=8, turns=6, first=64, user=32, max_tokens=16), 28)
QUICK = Setup(Workload(conversations=4, turns=4, first=48, user=24, max_tokens=8), 16)


def _run(tmp: Path, setup: Setup, workers: list[Proc], kvserver: str | None) -> WorkloadResult:
    args = [
        "--workers", ",".join(w.info["endpoint"] for w in workers),
        "--num-gpu-blocks", str(setup.num_gpu_blocks), "--block-size", str(BLOCK_SIZE),
        "--model", "tiny-bench-e2e", "--log-level", "WARNING",
    ]  # fmt: skip
    if kvserver is not None:
        args += ["--kvserver", kvserver, "--chunk-blocks", "1"]
    sched = start_scheduler(tmp, *args)
    w = setup.workload
    label = "with kvserver" if kvserver else "prefix cache only"
    try:
        with tqdm(total=w.conversations * w.turns, desc=label, unit="req") as bar:
            result = run_workload(sched.info["grpc_port"], w, progress=bar, timeout=120)
        if sched.terminate() != 0:
            raise RuntimeError(f"scheduler failed:\n{sched.log()}")
    finally:
        sched.kill()
    return result


def _totals(r: WorkloadResult) -> dict[str, int]:
    return {
        "prompt": sum(len(t.prompt) for t in r.turns),
        "gpu_cached": sum(t.gpu_cached for t in r.turns),
        "kvserver": sum(t.kvserver for t in r.turns),
        "computed": sum(t.computed for t in r.turns),
    }


def _row(name: str, value: float, unit: str, reference: float) -> dict[str, Any]:
    return {"name": name, "value": value, "unit": unit, "reference": reference,
            "ratio": value / reference if reference else 0.0}  # fmt: skip


def measure(setup: Setup) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as d:
        tmp = Path(d)
        daemon = start_daemon(tmp / "daemon", "--dram", "64MiB", *RECORDED_POLICY)
        workers: list[Proc] = []
        try:
            workers = start_tp_workers(tmp, daemon.zmq_address)
            t0 = time.perf_counter()
            off = _run(tmp, setup, workers, None)
            t1 = time.perf_counter()
            on = _run(tmp, setup, workers, daemon.zmq_address)
            t2 = time.perf_counter()
            for w in workers:
                w.terminate()
        finally:
            for w in workers:
                w.kill()
            daemon.kill()
    if [t.output for t in off.turns] != [t.output for t in on.turns]:
        raise RuntimeError("the two runs generated different tokens")
    ideal_per_turn = ideal_reusable(on.turns, BLOCK_SIZE)
    ideal = sum(ideal_per_turn)
    achievable = sum(ideal_reusable(on.turns, BLOCK_SIZE, kv_computed_only=True))
    a, b = _totals(off), _totals(on)
    prompt = a["prompt"]
    results = [
        _row("prompt tokens", prompt, "tokens", prompt),
        _row("ideal reusable prompt tokens (infinite cache)", ideal, "tokens", prompt),
        _row("ideal reusable, KV-computed tokens only", achievable, "tokens", prompt),
        _row("computed prompt tokens, prefix cache only", a["computed"], "tokens", prompt),
        _row("computed prompt tokens, with kvserver", b["computed"], "tokens", a["computed"]),
        _row("ideal reuse achieved, prefix cache only", prompt - a["computed"], "tokens", ideal),
        _row("ideal reuse achieved, with kvserver", prompt - b["computed"], "tokens", ideal),
        _row(
            "reuse achieved vs KV-computed ideal, with kvserver",
            prompt - b["computed"],
            "tokens",
            achievable,
        ),
        _row("prompt tokens loaded from kvserver", b["kvserver"], "tokens", ideal),
    ]
    wl = setup.workload
    return {
        "meta": {
            "conversations": wl.conversations,
            "turns": wl.turns,
            "first_prompt": wl.first,
            "user_tokens": wl.user,
            "max_tokens": wl.max_tokens,
            "block_size": BLOCK_SIZE,
            "chunk_blocks": 1,
            "num_gpu_blocks": setup.num_gpu_blocks,
            "tp": 2,
            "device": "cpu",
            "cpus": os.cpu_count(),
            "sources": {"off": a, "on": b},
            "ideal_per_request": ideal_per_turn,
            "wall_s": {"off": round(t1 - t0, 2), "on": round(t2 - t1, 2)},
            "per_request": {
                "off": [[t.gpu_cached, t.kvserver, t.computed] for t in off.turns],
                "on": [[t.gpu_cached, t.kvserver, t.computed] for t in on.turns],
            },
        },
        "results": results,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = report["meta"]
    prompt = sum(r["value"] for r in report["results"] if r["name"] == "prompt tokens")
    ideal = next(r["value"] for r in report["results"] if r["name"].startswith("ideal reusable"))
    rows = [
        ("prefix cache only", meta["sources"]["off"]),
        ("with kvserver", meta["sources"]["on"]),
        ("ideal (infinite cache)", {"gpu_cached": ideal, "kvserver": 0,
                                    "computed": prompt - ideal}),
    ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [r[0] for r in rows]
    left = [0.0] * len(rows)
    for key, label, color in (("gpu_cached", "reused (GPU prefix cache / ideal)", "#4c72b0"),
                              ("kvserver", "loaded from kvserver", "#55a868"),
                              ("computed", "computed", "#c44e52")):  # fmt: skip
        vals = [float(r[1][key]) for r in rows]
        ax.barh(names, vals, left=left, color=color, label=label)
        left = [x + v for x, v in zip(left, vals, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("prompt tokens")
    ax.set_title(
        f"{meta['conversations']} conversations x {meta['turns']} turns, TP={meta['tp']}, "
        f"{meta['num_gpu_blocks']} GPU blocks of {meta['block_size']}"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a smaller workload (seconds)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/e2e.json"))
    args = ap.parse_args(argv)
    report = measure(QUICK if args.quick else FULL)
    report["meta"]["quick"] = args.quick
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.json.with_suffix(".png"))
    width = max(len(r["name"]) for r in report["results"])
    print(f"{'name':<{width}}  {'value':>8}  {'reference':>9}  ratio")
    for r in report["results"]:
        print(f"{r['name']:<{width}}  {r['value']:>8}  {r['reference']:>9}  {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
