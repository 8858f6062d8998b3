"""Configuration: the scheduler (:class:`SchedulerConfig`) and its process (:class:`ProcessConfig`).

Plain values, validated once in ``__post_init__`` and passed down; derived values are
properties. Invalid values raise :class:`~kvserver.errors.InvalidArgument` naming the field, so
the CLI can print one clear line and exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserver.client.common import data_address, endpoint_problem
from kvserver.crypto import CurveClient, TlsServer, is_loopback
from kvserver.errors import InvalidArgument
from kvserver.grpc_limit import MAX_CONNECTIONS_PER_ADDRESS
from kvserver.hashing import DEFAULT_SEED, HASH_ALGOS
from step_protocol.limits import derived_limit, limit_bytes, plan_bytes_bound, reply_bytes_bound
from step_protocol.security import check_worker_addresses

#: scheduling policies: first come first served, or by priority.
POLICIES: tuple[str, ...] = ("fcfs", "priority")


def _check_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}", **{name: value})


#: the scheduler's Prometheus port (next to its gRPC port 9480).
DEFAULT_METRICS_PORT = 9481


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What :class:`~scheduler.scheduler.Scheduler` needs; see docs/scheduler.md.

    - ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is the null block, so
      ``num_gpu_blocks - 1`` are usable.
    - ``max_num_batched_tokens``: the one token budget per step, shared by prefill and decode.
    - ``max_num_seqs``: most requests in the running list.
    - ``long_prefill_token_threshold``: most tokens one request gets in one step (0 = no cap
      beyond the budget). With ``enable_chunked_prefill`` off a prompt is only admitted when it
      fits the step's remaining budget whole.
    - ``max_model_len``: prompt + output cap per request (0 = every usable block).
    - ``hash_algo`` / ``hash_seed``: the block-hash chain; must match kvserver's namespace.
    - ``trace_path``: per-step JSONL trace, ``None`` = off.
    """

    num_gpu_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    max_model_len: int = 0
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256_cbor"
    hash_seed: str = DEFAULT_SEED
    trace_path: str | None = None

    def __post_init__(self) -> None:
        _check_int("num_gpu_blocks", self.num_gpu_blocks, 2)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("max_model_len", self.max_model_len, 0)
        if self.policy not in POLICIES:
            raise InvalidArgument(
                f"unknown policy; valid choices: {', '.join(POLICIES)}", policy=self.policy
            )
        if self.hash_algo not in HASH_ALGOS:
            raise InvalidArgument(
                f"unknown hash_algo; valid choices: {', '.join(HASH_ALGOS)}",
                hash_algo=self.hash_algo,
            )
        if not isinstance(self.hash_seed, str):
            raise InvalidArgument("hash_seed must be a str", hash_seed=self.hash_seed)
        if self.max_model_len > self.usable_blocks * self.block_size:
            raise InvalidArgument(
                "max_model_len exceeds the GPU block pool (num_gpu_blocks - 1 blocks)",
                max_model_len=self.max_model_len,
                pool_tokens=self.usable_blocks * self.block_size,
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.model_len:
            raise InvalidArgument(
                "without chunked prefill max_num_batched_tokens must cover max_model_len",
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.model_len,
            )

    @property
    def usable_blocks(self) -> int:
        """Blocks that requests can hold (all but the null block)."""
        return self.num_gpu_blocks - 1

    @property
    def model_len(self) -> int:
        """The effective ``max_model_len``: prompt + output tokens one request may reach."""
        return self.max_model_len or self.usable_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    """How ``kvserver scheduler`` runs: workers, front door, optional kvserver connector.

    Exactly one of ``workers`` (ZMQ addresses the workers bound) and ``synthetic_workers``
    (spawn that many ``python -m scheduler.synthetic`` children) is set.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: tuple[str, ...] = ()
    synthetic_workers: int = 0
    host: str = "127.0.0.1"
    grpc_port: int = 9480
    #: Prometheus /metrics over HTTP (docs/metrics.md); 0 = ephemeral, -1 = disabled.
    metrics_port: int = DEFAULT_METRICS_PORT
    #: kvserver daemon ZMQ address (``tcp://host:port``); None = no connector.
    kvserver: str | None = None
    #: the daemon's token ("": the one a daemon on this host left for its user)
    kvserver_auth_token: str = ""
    #: CURVE settings for a daemon that uses CURVE (docs/security.md)
    kvserver_curve: CurveClient | None = None
    #: the connector's bounds (KVConnectorConfig): the lookup inside a step's admission, and
    #: pin / reserve / complete calls
    kvserver_lookup_timeout_s: float = 0.1
    kvserver_op_timeout_s: float = 1.0
    #: the front door's most connections from one address (the newest past it are shut down
    #: within 0.5 s; kvserver/grpc_limit.py), as the daemon's setting of that name: raise it
    #: where many clients share an address (behind NAT or a proxy)
    grpc_max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS
    #: TLS for the gRPC front door (and the /metrics port's host): certificate, key, client CA
    tls: TlsServer | None = None
    #: the front door's token ("": a random one made at start, left for this user in
    #: ``kvserver/token_file.py``'s file of the gRPC port, unless ``engine_no_auth``)
    engine_auth_token: str = ""
    #: the front door takes no token: every local user (and every host it listens to) may use it
    engine_no_auth: bool = False
    #: CURVE on the step channel: the workers' public key and this scheduler's pair
    step_curve: CurveClient | None = None
    #: the front door (and the step channel) beyond loopback in clear text: an explicit choice
    insecure_remote: bool = False
    #: the largest worker reply taken, MiB (0: derived from the batch settings,
    #: :attr:`reply_limit_bytes`)
    step_max_message_mib: float = 0.0
    chunk_blocks: int = 1
    model: str = "synthetic"
    step_timeout_s: float = 10.0
    hello_timeout_s: float = 30.0
    #: seconds between attempts to reconnect a failed worker
    probe_interval_s: float = 1.0
    #: simulated compute time of each synthetic worker step, milliseconds
    synthetic_delay_ms: float = 0.0
    #: seconds in-flight Generate streams get at shutdown before they are cancelled
    shutdown_grace_s: float = 2.0
    ready_file: str | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if bool(self.workers) == bool(self.synthetic_workers):
            raise InvalidArgument("give exactly one of --workers and --synthetic-workers")
        _check_int("synthetic_workers", self.synthetic_workers, 0)
        _check_int("grpc_port", self.grpc_port, 0)
        _check_int("metrics_port", self.metrics_port, -1)
        _check_int("grpc_max_connections_per_address", self.grpc_max_connections_per_address, 1)
        if self.metrics_port > 65535 or self.grpc_port > 65535:
            raise InvalidArgument(
                "port out of range", grpc_port=self.grpc_port, metrics_port=self.metrics_port
            )
        _check_int("chunk_blocks", self.chunk_blocks, 1)
        for address in self.workers:
            if not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidArgument("worker address must be a ZMQ endpoint", address=address)
            why = "" if address.startswith("inproc://") else endpoint_problem(address)
            if why:  # was: a ZMQError traceback at connect (no port, "ipc://"), or a hello
                raise InvalidArgument(  # timed out for ever (port 0 or 99999)
                    f"bad worker address {address[:200]!r}: {why}; give tcp://HOST:PORT or "
                    "ipc://PATH"
                )
        if self.tls is None and not self.insecure_remote and not is_loopback(self.host):
            raise InvalidArgument(
                f"host {self.host} is beyond loopback: set tls_cert_file and tls_key_file "
                "(TLS on the gRPC front door, docs/security.md; make them with 'kvserver keys "
                "tls'), or pass --insecure-remote to serve gRPC in clear"
            )
        if self.engine_auth_token and self.engine_no_auth:
            raise InvalidArgument("engine_auth_token excludes engine_no_auth")
        if not isinstance(self.engine_auth_token, str) or any(
            c in self.engine_auth_token for c in "\r\n\0"
        ):
            raise InvalidArgument("engine_auth_token must be one line of text")
        check_worker_addresses(self.workers, self.step_curve, self.insecure_remote)
        if self.kvserver is not None:
            try:
                data_address(self.kvserver)  # at start-up, naming the flag: not at the first call
            except InvalidArgument as exc:
                raise InvalidArgument(f"kvserver: {exc.message}") from None
        for name in ("step_timeout_s", "hello_timeout_s", "probe_interval_s",
                     "kvserver_lookup_timeout_s", "kvserver_op_timeout_s"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise InvalidArgument(f"{name} must be > 0", **{name: value})
        if self.step_max_message_mib:
            limit_bytes(self.step_max_message_mib)
        if self.synthetic_delay_ms < 0 or self.shutdown_grace_s < 0:
            raise InvalidArgument("synthetic_delay_ms and shutdown_grace_s must be >= 0")
        from kvserver.daemon.config import LOG_LEVELS  # the daemon's: the logging names

        if self.log_level.upper() not in LOG_LEVELS:  # was: taken as INFO without a word
            raise InvalidArgument(
                f"log_level must be one of {', '.join(LOG_LEVELS)}", value=self.log_level
            )

    @property
    def num_workers(self) -> int:
        return len(self.workers) or self.synthetic_workers

    @property
    def plan_bytes_bound(self) -> int:
        """The largest step plan these settings can send (``step_protocol/limits.py``)."""
        s = self.scheduler
        return plan_bytes_bound(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            model_len=s.model_len, num_gpu_blocks=s.num_gpu_blocks, world_size=self.num_workers,
        )  # fmt: skip

    @property
    def reply_limit_bytes(self) -> int:
        """The step channel's limit on a worker's reply: ``step_max_message_mib``, else a
        multiple of the largest reply these settings allow, at least 64 MiB."""
        if self.step_max_message_mib:
            return limit_bytes(self.step_max_message_mib)
        s = self.scheduler
        bound = reply_bytes_bound(max_num_seqs=s.max_num_seqs, num_gpu_blocks=s.num_gpu_blocks)
        return derived_limit(bound)
