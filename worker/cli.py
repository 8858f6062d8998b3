"""``kvserver worker``: one TP rank of a real model behind the step protocol (worker/process.py).

Importing this module does not import torch (``kvserver start`` must stay torch-free); the
command function does.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvserver.errors import KVServerError


def add_worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        help="run one tensor-parallel rank of a model for the scheduler (needs torch)",
        description=(
            "Run one TP rank of a small transformer in the foreground: bind a ZMQ ROUTER at "
            "--listen for the scheduler (kvserver scheduler --workers ...), join the TP group "
            "at --dist-init, and with --kvserver load/store prompt KV through a kvserver daemon."
        ),
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--listen", required=True, help="ZMQ endpoint to bind, e.g. tcp://0.0.0.0:9500")
    p.add_argument(
        "--dist-init", required=True, help="torch.distributed init address (tcp://HOST:PORT)"
    )
    p.add_argument("--model-file", required=True, help="safetensors file with the full weights")
    p.add_argument(
        "--write-random-model-seed",
        type=int,
        metavar="S",
        help="first write a random model (seed S) to --model-file if it does not exist",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kvserver", metavar="ADDR", help="kvserver daemon ZMQ address (default off)")
    p.add_argument("--chunk-blocks", type=int, default=1, help="must match the scheduler's")
    p.add_argument("--hash-algo", default="sha256_cbor", help="must match the scheduler's")
    p.add_argument("--hash-seed", default="vllm-none-hash", help="must match the scheduler's")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--ready-file", help="write JSON {pid, endpoint, rank} here once serving")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import os

    import torch

    from worker.model import load_model, write_random_model
    from worker.process import KVServerSettings, ModelWorker, init_distributed, serve

    try:
        if args.threads > 0 and args.device == "cpu":
            torch.set_num_threads(args.threads)
        device = args.device
        if device == "cuda":
            torch.cuda.set_device(args.rank % max(1, torch.cuda.device_count()))
            device = f"cuda:{torch.cuda.current_device()}"
        if args.write_random_model_seed is not None and not os.path.exists(args.model_file):
            tmp = f"{args.model_file}.tmp{os.getpid()}"
            write_random_model(tmp, seed=args.write_random_model_seed)
            os.replace(tmp, args.model_file)  # ranks racing to write it write the same bytes
        model = load_model(
            args.model_file, rank=args.rank, world_size=args.world_size, device=device
        )
        init_distributed(args.rank, args.world_size, args.dist_init, device)
        kv = None
        if args.kvserver:
            kv = KVServerSettings(args.kvserver, args.chunk_blocks, args.hash_algo, args.hash_seed)
        return serve(ModelWorker(model, kv), args.listen, ready_file=args.ready_file)
    except KVServerError as exc:
        print(f"kvserver worker: {exc}", file=sys.stderr)
        return 1
