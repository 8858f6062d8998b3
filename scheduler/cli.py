"""``kvserver scheduler``: parse flags into a ProcessConfig and run the scheduler process."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from kvserver.crypto import ClientSecurity, TlsServer, add_client_security_args
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.files import check_writable
from kvserver.token_file import client_auth_token, read_token_file
from step_protocol import limits as step_limits
from step_protocol import security as step_security

if TYPE_CHECKING:
    from scheduler.config import ProcessConfig


def add_scheduler(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvserver.grpc_limit import MAX_CONNECTIONS_PER_ADDRESS
    from scheduler.config import POLICIES, SchedulerConfig

    d = SchedulerConfig()
    p = sub.add_parser(
        "scheduler",
        help="run the scheduler process (queues, GPU block pool, gRPC Engine front door)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run the scheduler in the foreground until SIGTERM or SIGINT (Ctrl-C): it plans\n"
            "every engine step for its workers (ZMQ), serves gRPC kvserver.v1.Engine (Generate)\n"
            "and, with --kvserver, loads and stores prompt KV through a kvserver daemon. Workers\n"
            "are either ZMQ addresses of running worker processes (--workers) or synthetic\n"
            "workers it starts itself (--synthetic-workers N: deterministic tokens, no model,\n"
            "no GPU). Binds to loopback unless --host says otherwise. Durations are seconds\n"
            "(-s) or milliseconds (-ms), as their names say."
        ),
        epilog=(
            "examples:\n"
            "  kvserver scheduler --synthetic-workers 2          # no model, no GPU: a try-out\n"
            "  kvserver scheduler --synthetic-workers 1 --kvserver tcp://127.0.0.1:9471\n"
            "  kvserver scheduler --workers tcp://127.0.0.1:9500,tcp://127.0.0.1:9501\n"
            "  kvserver scheduler --synthetic-workers 1 --grpc-port 0 --ready-file ready.json\n\n"
            "exit status: 0 stopped in order, 1 could not start (why on stderr), 2 bad\n"
            "arguments or files (a key, a certificate, the ready file)"
        ),
    )
    w = p.add_mutually_exclusive_group(required=True)
    # the options as a table, one or two lines each
    # fmt: off
    w.add_argument("--workers", metavar="ADDR,...",
                   help="comma-separated worker addresses (kvserver worker --listen), rank order: "
                   "tcp://HOST:PORT or ipc://PATH")
    w.add_argument("--synthetic-workers", type=int, metavar="N", help="start N synthetic workers")
    p.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="gRPC and metrics bind address (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=9480, metavar="PORT",
                   help="gRPC port (default 9480, 0=any)")
    p.add_argument(
        "--grpc-max-connections-per-address", type=int, default=MAX_CONNECTIONS_PER_ADDRESS,
        metavar="N",
        help="most gRPC connections from one address; the newest past it are shut down "
        f"(default {MAX_CONNECTIONS_PER_ADDRESS}; raise it behind NAT or a proxy)",
    )  # fmt: skip
    p.add_argument("--tls-cert-file", metavar="PEM", default="",
                   help="gRPC front door TLS: certificate chain (docs/security.md)")
    p.add_argument("--tls-key-file", metavar="PEM", default="",
                   help="gRPC front door TLS: private key")
    p.add_argument("--tls-client-ca-file", metavar="PEM", default="",
                   help="gRPC mutual TLS: client certificates must be signed by this CA")
    p.add_argument(
        "--engine-auth-token", metavar="TOKEN",
        default=os.environ.get("KVSERVER_ENGINE_AUTH_TOKEN", ""),
        help="the token gRPC clients must present (default: $KVSERVER_ENGINE_AUTH_TOKEN, else "
        "a random one, left for this user in a 0600 file; docs/security.md)",
    )  # fmt: skip
    p.add_argument(
        "--engine-auth-token-file", metavar="FILE",
        default=os.environ.get("KVSERVER_ENGINE_AUTH_TOKEN_FILE", ""),
        help="read that token from FILE (default: $KVSERVER_ENGINE_AUTH_TOKEN_FILE; 'kvserver "
        "keys token DIR --name engine' makes one; wins over --engine-auth-token)",
    )  # fmt: skip
    p.add_argument(
        "--engine-no-auth", action="store_true",
        help="the gRPC front door takes no token (any local user may then call Generate)",
    )  # fmt: skip
    step_security.add_scheduler_args(p)
    step_security.add_insecure_remote_arg(
        p, "the gRPC front door (--host) and the step channel (--workers)"
    )
    step_limits.add_limit_arg(p, scheduler=True)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9481,
        metavar="PORT",
        help="Prometheus /metrics HTTP port (default 9481, 0=any, -1=off)",
    )
    p.add_argument(
        "--kvserver",
        metavar="ADDR",
        help="kvserver daemon ZMQ address, e.g. tcp://127.0.0.1:9471 (default: off)",
    )
    add_client_security_args(p, curve=True, token=True)
    p.add_argument(
        "--kvserver-lookup-timeout-s", type=float, default=0.1, metavar="S",
        help="bound on the daemon lookup inside a step's admission; a late one is no hit and "
        "skips the daemon for a while (default 0.1)",
    )  # fmt: skip
    p.add_argument(
        "--kvserver-op-timeout-s", type=float, default=1.0, metavar="S",
        help="bound on the connector's pin / reserve / complete calls (default 1.0)",
    )  # fmt: skip
    p.add_argument("--model", default="synthetic", metavar="NAME",
                   help="model name (part of the namespace; default synthetic)")
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, metavar="N",
                   help=f"GPU KV blocks the workers hold (default {d.num_gpu_blocks})")
    p.add_argument("--block-size", type=int, default=d.block_size, metavar="TOKENS",
                   help=f"tokens per GPU block (default {d.block_size})")
    p.add_argument("--chunk-blocks", type=int, default=1, metavar="K",
                   help="GPU blocks per kvserver chunk (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help=f"requests running at once, at most (default {d.max_num_seqs})")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        metavar="TOKENS",
        help="the token budget per step, shared by prefill and decode "
        f"(default {d.max_num_batched_tokens})",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        metavar="TOKENS",
        help="most tokens of one prompt per step (0 = no cap)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="admit a prompt only when it fits the step whole",
    )
    p.add_argument("--max-model-len", type=int, default=0, metavar="TOKENS",
                   help="longest prompt + output (default 0: the whole block pool)")
    p.add_argument("--policy", default="fcfs", choices=POLICIES,
                   help="which waiting request goes first: fcfs or priority (default fcfs)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the GPU blocks of earlier prompts")
    p.add_argument("--hash-algo", default=d.hash_algo, metavar="ALGO",
                   help=f"block hash algorithm, as the namespace's (default {d.hash_algo})")
    p.add_argument("--hash-seed", default=d.hash_seed, metavar="SEED",
                   help="NONE_HASH seed (vLLM's PYTHONHASHSEED)")
    p.add_argument("--trace", metavar="FILE", help="append a per-step JSONL trace here")
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a worker silent this long on a step is failed (default 10)",
    )
    p.add_argument(
        "--hello-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="how long the workers may take to answer the first hello (loading a model; "
        "default 30)",
    )
    p.add_argument(
        "--probe-interval-s", type=float, default=1.0, metavar="S",
        help="how often failed workers are retried (default 1)",
    )
    p.add_argument(
        "--synthetic-delay-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="simulated compute time per synthetic step (default 0)",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=2.0,
        metavar="S",
        help="at SIGTERM, seconds in-flight streams get before they are cancelled (default 2)",
    )
    p.add_argument("--ready-file", metavar="FILE",
                   help="write JSON {pid, grpc_port, workers} here once serving")
    p.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="DEBUG, INFO (default), WARNING, ERROR")
    # fmt: on
    p.set_defaults(func=_cmd_scheduler)


def _tls(args: argparse.Namespace) -> TlsServer | None:
    """The front door's TLS from the flags (files read now: a bad one is a usage error)."""
    if not (args.tls_cert_file or args.tls_key_file or args.tls_client_ca_file):
        return None
    if not (args.tls_cert_file and args.tls_key_file):
        raise InvalidArgument("tls_cert_file and tls_key_file go together")
    tls = TlsServer(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    tls.credentials()
    return tls


def _engine_token(args: argparse.Namespace) -> str:
    """The front door's token from the flags ("" = made at start); the file is read now."""
    path = getattr(args, "engine_auth_token_file", "") or ""
    token = getattr(args, "engine_auth_token", "") or ""
    if path:
        token = read_token_file(path, "engine_auth_token_file")
    if token and getattr(args, "engine_no_auth", False):
        raise InvalidArgument("engine_auth_token(_file) excludes engine_no_auth")
    return token


def process_config(args: argparse.Namespace) -> ProcessConfig:
    """The ProcessConfig of parsed ``kvserver scheduler`` arguments (key and certificate files
    read now). Raises KVServerError (InvalidArgument) for a bad value or file."""
    from scheduler.config import ProcessConfig, SchedulerConfig

    if args.ready_file:  # was: a traceback once serving, the scheduler then stopped
        check_writable(args.ready_file, "--ready-file")
    if args.trace:  # was: "cannot open the trace file" after the workers' start, exit 1
        check_writable(args.trace, "--trace")
    return ProcessConfig(
        scheduler=SchedulerConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_chunked_prefill=not args.no_chunked_prefill,
            max_model_len=args.max_model_len,
            policy=args.policy,
            enable_prefix_caching=not args.no_prefix_caching,
            hash_algo=args.hash_algo,
            hash_seed=args.hash_seed,
            trace_path=args.trace,
        ),
        workers=tuple(a.strip() for a in (args.workers or "").split(",") if a.strip()),
        synthetic_workers=args.synthetic_workers or 0,
        host=args.host,
        grpc_port=args.grpc_port,
        grpc_max_connections_per_address=args.grpc_max_connections_per_address,
        metrics_port=args.metrics_port,
        kvserver=args.kvserver,
        kvserver_auth_token=client_auth_token(args),
        kvserver_curve=ClientSecurity(  # its --tls-* flags are the front door's own
            args.curve_server_key_file, args.curve_secret_key_file
        ).curve(),
        kvserver_lookup_timeout_s=args.kvserver_lookup_timeout_s,
        kvserver_op_timeout_s=args.kvserver_op_timeout_s,
        tls=_tls(args),
        engine_auth_token=_engine_token(args),
        engine_no_auth=args.engine_no_auth,
        step_curve=step_security.scheduler_curve(args),
        insecure_remote=args.insecure_remote,
        step_max_message_mib=args.step_max_message_mib,
        chunk_blocks=args.chunk_blocks,
        model=args.model,
        step_timeout_s=args.step_timeout_s,
        hello_timeout_s=args.hello_timeout_s,
        probe_interval_s=args.probe_interval_s,
        synthetic_delay_ms=args.synthetic_delay_ms,
        shutdown_grace_s=args.shutdown_grace_s,
        ready_file=args.ready_file,
        log_level=args.log_level,
    )


def _cmd_scheduler(args: argparse.Namespace) -> int:
    try:
        config = process_config(args)
    except KVServerError as exc:
        print(f"kvserver scheduler: error: {exc}", file=sys.stderr)
        return 2
    from kvserver.grpc_engine import use_polling_engine

    use_polling_engine()  # before grpc is imported: fewer thread wake-ups per call, as the daemon
    from scheduler.process import main

    try:
        return main(config)
    except KVServerError as exc:
        print(f"kvserver scheduler: error: {exc}", file=sys.stderr)
        return 1
