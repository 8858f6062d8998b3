"""``kvserver worker``: one TP rank of a real model behind the step protocol (worker/process.py).

Importing this module does not import torch (``kvserver start`` must stay torch-free); the
command function does, after the arguments have been checked: a missing torch, a missing model
file, ``--device cuda`` without CUDA or a malformed ``--listen`` is a one-line message and exit
status 2 (usage), a failure while serving (an address in use, a broken model file) one line
and exit status 1; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from kvserver.crypto import ClientSecurity, add_client_security_args
from kvserver.errors import KVServerError
from kvserver.token_file import client_auth_token
from step_protocol import security as step_security

#: what ``--listen`` accepts: a ZMQ endpoint this worker can bind
_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?:\d{1,5}|\*)|ipc://\S+")


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
    p.add_argument("--rank", type=int, required=True, help="this worker's tensor-parallel rank")
    p.add_argument("--world-size", type=int, required=True, help="tensor-parallel ranks in all")
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
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    p.add_argument("--kvserver", metavar="ADDR", help="kvserver daemon ZMQ address (default off)")
    add_client_security_args(p, curve=True, token=True)
    step_security.add_worker_args(p)
    step_security.add_insecure_remote_arg(p, "the step channel (--listen)")
    p.add_argument("--chunk-blocks", type=int, default=1, help="must match the scheduler's")
    p.add_argument("--hash-algo", default="sha256_cbor", help="must match the scheduler's")
    p.add_argument("--hash-seed", default="vllm-none-hash", help="must match the scheduler's")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument(
        "--host-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: move staged copies' host side with indexed kernels over the page-locked "
        'arena where its pieces are small (default on; docs/worker.md, "Copies")',
    )
    p.add_argument("--ready-file", help="write JSON {pid, endpoint, rank} here once serving")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING, ERROR")
    p.set_defaults(func=_cmd_worker)


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (checked before any start-up work), or None."""
    if not _ENDPOINT.fullmatch(args.listen):
        return (
            f"bad --listen {args.listen!r}: expected a ZMQ endpoint such as "
            "tcp://0.0.0.0:9500, tcp://127.0.0.1:0 or ipc:///tmp/worker.sock"
        )
    port = args.listen.rpartition(":")[2]
    if args.listen.startswith("tcp://") and port != "*" and int(port) > 65535:
        return f"bad --listen {args.listen!r}: port out of range"
    if not os.path.isfile(args.model_file) and args.write_random_model_seed is None:
        return (
            f"model file not found: {args.model_file} (give a safetensors file, or add "
            "--write-random-model-seed S to write a random test model there first)"
        )
    try:
        import torch
    except ImportError as exc:
        return (
            f"needs torch, which is not installed ({exc}); install kvserver with the "
            "worker's extra from a checkout: pip install '.[torch]'"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no usable GPU"
        return f"--device cuda, but torch {torch.__version__} has {build}; use --device cpu"
    return None


def _cmd_worker(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem is None:
        try:  # the key files are read now: a bad one is a usage error
            curve = ClientSecurity.from_mapping(args).curve()
            token = client_auth_token(args)
            step_curve = step_security.worker_curve(args)
            step_security.check_worker_listen(args.listen, step_curve, args.insecure_remote)
        except KVServerError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"kvserver worker: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import torch
    import zmq

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
            # atomic: ranks racing to write it write the same bytes
            write_random_model(args.model_file, seed=args.write_random_model_seed)
        model = load_model(
            args.model_file, rank=args.rank, world_size=args.world_size, device=device
        )
        init_distributed(args.rank, args.world_size, args.dist_init, device)
        kv = None
        if args.kvserver:
            kv = KVServerSettings(
                args.kvserver, args.chunk_blocks, args.hash_algo, args.hash_seed,
                auth_token=token, curve=curve, host_kernels=args.host_kernels,
            )  # fmt: skip
        return serve(ModelWorker(model, kv), args.listen, ready_file=args.ready_file,
                     curve=step_curve, no_auth=args.step_no_auth)  # fmt: skip
    except KVServerError as exc:
        print(f"kvserver worker: error: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:
        print(f"kvserver worker: error: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as exc:  # unreadable model, rendezvous failure
        logging.getLogger("worker").debug("worker failed", exc_info=True)  # --log-level DEBUG
        print(f"kvserver worker: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
