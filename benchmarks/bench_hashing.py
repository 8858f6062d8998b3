"""Block-hashing throughput: a 32k-token prompt (2,048 blocks of 16) per hash algorithm.

This is the work the daemon does for a gRPC Lookup by token ids (target: p99 <= 2 ms for
the whole call), so the per-prompt time is printed too. Reference, measured in the same run:
hashlib.sha256 over the same token ids packed as 4-byte ints, in one call: the raw hashing floor
with no per-block Python work. ratio = tokens/s of the algorithm / tokens/s of the reference.

Usage: python benchmarks/bench_hashing.py [--quick] [--json FILE]
With --json, also writes FILE with the .png suffix (a bar chart) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.report import save_report
from kvserver.hashing import HASH_ALGOS, BlockHasher

NUM_TOKENS = 32 * 1024
BLOCK_SIZE = 16
VOCAB_SIZE = 128_256  # Llama 3
TURN_TOKENS = 1024  # a new turn appended to an already-hashed prompt


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call costs (the CBOR integer table) are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_with_setup(setup: Callable[[], Callable[[], object]], repeats: int) -> float:
    """Median seconds of ``setup()()`` where only the returned call is timed."""
    setup()()  # warm-up
    times = []
    for _ in range(repeats):
        fn = setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(repeats: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB_SIZE) for _ in range(NUM_TOKENS)]
    token_bytes = array("I", tokens).tobytes()
    ref_s = median_seconds(lambda: hashlib.sha256(token_bytes).digest(), repeats)
    reference = NUM_TOKENS / ref_s
    results = []
    for algo in HASH_ALGOS:

        def cold(algo: str = algo) -> Callable[[], object]:
            """A hasher that has seen nothing: every block is hashed."""
            return partial(BlockHasher(algo, BLOCK_SIZE).hash_blocks, tokens)

        def next_turn(algo: str = algo) -> Callable[[], object]:
            """The prompt's first TURN_TOKENS-shorter prefix was hashed before (the previous
            turn of the conversation): only the new turn is hashed."""
            hasher = BlockHasher(algo, BLOCK_SIZE)
            hasher.hash_blocks(tokens[:-TURN_TOKENS])
            return partial(hasher.hash_blocks, tokens)

        hasher = BlockHasher(algo, BLOCK_SIZE)
        assert len(hasher.hash_blocks(tokens)) == NUM_TOKENS // BLOCK_SIZE
        cases = (
            ("cold", median_with_setup(cold, repeats)),
            (f"prefix seen, +{TURN_TOKENS} new", median_with_setup(next_turn, repeats)),
            ("same prompt again", median_seconds(partial(hasher.hash_blocks, tokens), repeats)),
        )
        for case, seconds in cases:
            value = NUM_TOKENS / seconds
            results.append(
                {
                    "name": f"hash_blocks[{algo}] 32k tokens, {case}",
                    "value": value,
                    "unit": "tokens/s",
                    "reference": reference,
                    "ratio": value / reference,
                }
            )
    return results


def print_table(results: list[dict[str, Any]], repeats: int) -> None:
    reference = results[0]["reference"]
    print(f"{NUM_TOKENS} tokens, block size {BLOCK_SIZE}, median of {repeats} runs")
    print(f"{'what':<62} {'Mtokens/s':>10} {'ms/prompt':>10} {'ratio':>8}")
    for row in results:
        ms = NUM_TOKENS / row["value"] * 1e3
        print(f"{row['name']:<62} {row['value'] / 1e6:>10.2f} {ms:>10.3f} {row['ratio']:>8.4f}")
    ref_ms = NUM_TOKENS / reference * 1e3
    name = "reference: sha256 of token bytes, one call"
    print(f"{name:<62} {reference / 1e6:>10.2f} {ref_ms:>10.3f}")


def write_chart(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r["name"].removeprefix("hash_blocks[").replace("] 32k tokens,", "") for r in results]
    values = [r["value"] / 1e6 for r in results]
    fig, ax = plt.subplots(figsize=(8, 5))
    values.append(results[0]["reference"] / 1e6)
    ax.barh([*names, "reference\n(sha256, one call)"], values)
    ax.set_xscale("log")
    ax.set_xlabel("Mtokens/s (log scale)")
    ax.set_title(f"Block hashing, {NUM_TOKENS} tokens, block size {BLOCK_SIZE}")
    for y, value in enumerate(values):
        ax.annotate(
            f"{value:.1f}", (value, y), xytext=(3, 0), textcoords="offset points", va="center"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 runs per case instead of 51")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON here")
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else 51
    results = run(repeats)
    print_table(results, repeats)
    if args.json is not None:
        save_report(args.json, {"results": results}, lambda png: write_chart(results, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
