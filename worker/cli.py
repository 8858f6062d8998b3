"""``kvserver worker``: one TP rank of a real model behind the step protocol (worker/process.py).

Importing this module does not import torch (``kvserver start`` must stay torch-free); the
command function does, after the arguments have been checked: a missing torch, a missing model
file, ``--device cuda`` without CUDA, a malformed ``--listen``, ``--dist-init`` or ``--kvserver``,
a rank outside the world size, an unknown ``--log-level`` or a ``--ready-file`` that cannot be
written is a one-line message and exit status 2 (usage), a failure while serving (an address in
use, a model file that is not safetensors) one line and exit status 1; never a traceback.
Ctrl-C while rank 0 waits for the other ranks ends it as SIGINT does
(``worker.process.init_distributed``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from kvserver.crypto import ClientSecurity, add_client_security_args
from kvserver.errors import KVServerError
from kvserver.files import check_writable
from kvserver.token_file import client_auth_token
from step_protocol import limits as step_limits
from step_protocol import security as step_security

#: what ``--listen`` accepts: a ZMQ endpoint this worker can bind
_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?:\d{1,5}|\*)|ipc://\S+")
#: what ``--dist-init`` accepts: torch.distributed's rendezvous (``init_method``) URLs
_DIST_INIT = re.compile(r"tcp://\S+:\d{1,5}|file://\S+|env://")


def add_worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        help="run one tensor-parallel rank of a model for the scheduler (needs torch)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run one TP rank of a small transformer in the foreground until SIGTERM or SIGINT\n"
            "(Ctrl-C): bind a ZMQ ROUTER at --listen for the scheduler (kvserver scheduler\n"
            "--workers ...), join the TP group at --dist-init, and with --kvserver load/store\n"
            "prompt KV through a kvserver daemon."
        ),
        epilog=(
            "examples:\n"
            "  kvserver worker --rank 0 --world-size 1 --listen tcp://127.0.0.1:9500 "
            "--dist-init tcp://127.0.0.1:29500 --model-file model.safetensors "
            "--write-random-model-seed 0   # a test model\n"
            "  kvserver worker --rank 1 --world-size 2 --listen tcp://127.0.0.1:9501 "
            "--dist-init tcp://127.0.0.1:29500 --model-file model.safetensors "
            "--kvserver tcp://127.0.0.1:9471   # rank 1 of 2, KV through a daemon\n\n"
            "exit status: 0 stopped in order, 1 could not start or serve (why on stderr), 2 bad\n"
            "arguments (a missing model file, torch or CUDA included); killed by SIGINT when\n"
            "Ctrl-C comes while it waits for the other ranks"
        ),
    )
    # the options as a table, one or two lines each
    # fmt: off
    p.add_argument("--rank", type=int, required=True, metavar="R",
                   help="this worker's tensor-parallel rank, 0 to W-1")
    p.add_argument("--world-size", type=int, required=True, metavar="W",
                   help="tensor-parallel ranks in all (1: no torch.distributed group)")
    p.add_argument("--listen", required=True, metavar="ENDPOINT",
                   help="ZMQ endpoint to bind for the scheduler, e.g. tcp://127.0.0.1:9500 "
                   "(port 0 or *: any), ipc:///tmp/worker.sock")
    p.add_argument("--dist-init", required=True, metavar="URL",
                   help="torch.distributed rendezvous, the same for every rank: "
                   "tcp://HOST:PORT of rank 0's host (HOST:PORT free there), file://PATH")
    p.add_argument("--model-file", required=True, metavar="FILE",
                   help="safetensors file with the full weights (every rank reads it)")
    p.add_argument("--write-random-model-seed", type=int, metavar="S",
                   help="first write a random model (seed S) to --model-file if it does not "
                   "exist")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    p.add_argument("--kvserver", metavar="ADDR",
                   help="kvserver daemon ZMQ address, e.g. tcp://127.0.0.1:9471 (default off)")
    add_client_security_args(p, curve=True, token=True)
    step_security.add_worker_args(p)
    step_security.add_insecure_remote_arg(p, "the step channel (--listen)")
    step_limits.add_limit_arg(p, scheduler=False)
    p.add_argument("--chunk-blocks", type=int, default=1, metavar="K",
                   help="GPU blocks per kvserver chunk; must match the scheduler's (default 1)")
    p.add_argument("--hash-algo", default="sha256_cbor", metavar="ALGO",
                   help="block hash algorithm; must match the scheduler's (default sha256_cbor)")
    p.add_argument("--hash-seed", default="vllm-none-hash", metavar="SEED",
                   help="NONE_HASH seed; must match the scheduler's (default vllm-none-hash)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads on CPU (default 1; 0: torch's default)")
    p.add_argument(
        "--host-kernels", action=argparse.BooleanOptionalAction, default=True,
        help="CUDA: move staged copies' host side with indexed kernels over the page-locked "
        'arena where its pieces are small (default on; docs/worker.md, "Copies")',
    )
    p.add_argument("--ready-file", metavar="FILE",
                   help="write JSON {pid, endpoint, rank} here once serving")
    p.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="DEBUG, INFO (default), WARNING, ERROR")
    # fmt: on
    p.set_defaults(func=_cmd_worker)


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (checked before any start-up work), or None."""
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        return (
            f"--rank {args.rank} --world-size {args.world_size}: the world size is at least 1 "
            "and a rank is 0 to world size - 1"
        )
    if not _DIST_INIT.fullmatch(args.dist_init):
        return (
            f"bad --dist-init {args.dist_init!r}: expected torch.distributed's rendezvous "
            "address, the same for every rank, e.g. tcp://10.0.0.5:29500 (rank 0's host)"
        )
    from kvserver.daemon.config import LOG_LEVELS  # the daemon's: the logging module's names

    if args.log_level.upper() not in LOG_LEVELS:
        return f"bad --log-level {args.log_level!r}: give one of {', '.join(LOG_LEVELS)}"
    if args.threads < 0:
        return f"bad --threads {args.threads}: give 1 or more (0: torch's default)"
    if not _ENDPOINT.fullmatch(args.listen):
        return (
            f"bad --listen {args.listen!r}: expected a ZMQ endpoint such as "
            "tcp://0.0.0.0:9500, tcp://127.0.0.1:0 or ipc:///tmp/worker.sock"
        )
    port = args.listen.rpartition(":")[2]
    if args.listen.startswith("tcp://") and port != "*" and int(port) > 65535:
        return f"bad --listen {args.listen!r}: port out of range"
    try:  # what would fail only after the model is loaded, or at the scheduler's first hello
        if args.kvserver:
            from kvserver.client.common import data_address

            data_address(args.kvserver)
        if args.ready_file:
            check_writable(args.ready_file, "--ready-file")
    except KVServerError as exc:
        return str(exc).replace("bad daemon address", "bad --kvserver", 1)
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
            step_limit = step_limits.worker_limit(args)
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
    from safetensors import SafetensorError

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
                     curve=step_curve, no_auth=args.step_no_auth,
                     max_message_bytes=step_limit)  # fmt: skip
    except KVServerError as exc:
        print(f"kvserver worker: error: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:
        print(f"kvserver worker: error: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    except SafetensorError as exc:  # not a safetensors file, or a truncated one
        print(f"kvserver worker: error: cannot read --model-file {args.model_file}: {exc} "
              "(a safetensors file of the full weights)", file=sys.stderr)  # fmt: skip
        return 1
    except (OSError, ValueError, RuntimeError) as exc:  # unreadable model, rendezvous failure
        logging.getLogger("worker").debug("worker failed", exc_info=True)  # --log-level DEBUG
        print(f"kvserver worker: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
