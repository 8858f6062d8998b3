"""The plug-in's configuration: ``kv_connector_extra_config`` and the namespace of the model.

Both halves of the connector (the scheduler process and every worker) build the same
:class:`PluginConfig` from the same ``VllmConfig`` and ``KVCacheConfig``, so they register the
same :class:`~kvserver.namespace.NamespaceSpec` (same ``ns_id``) without talking to each other.

``kv_connector_extra_config`` keys (all optional; docs/vllm.md shows the command line)::

    address            "tcp://127.0.0.1:9471"  the daemon's ZMQ data plane
    chunk_blocks       16     vLLM blocks per stored chunk (the unit of storage and reuse)
    model_id           the served model name, else the model path: part of the namespace, so
                       every replica of one model must agree on it
    lookup_timeout_s   0.1    bound on the lookup inside get_num_new_matched_tokens
    lookup_reuse_s     0.25   a waiting request asked again reuses its last lookup for this
                              long, unless the connector saw its chunks change (0: never)
    op_timeout_s       1.0    bound on pin / reserve / complete calls
    down_backoff_s     5.0    how long an unreachable daemon is skipped before retrying
    lease_s            null   pin / reservation lifetime (null: the daemon's default)
    transfer_timeout_s 10.0   a worker's bound on one remote read or write
    colocated          null   null: map the daemon's arena when it runs on this host;
                              false: always send payload frames; true: require the arena
    auth_token         ""     the daemon's shared secret, if it has one
    auth_token_file    ""     a file holding it instead (0600; wins over auth_token)
    curve_server_key_file ""  the daemon's CURVE public key file (its NAME.key): required
                              when the daemon uses CURVE (docs/security.md)
    curve_secret_key_file ""  this engine's CURVE key pair (NAME.key_secret), when the daemon
                              admits listed clients only (curve_clients_dir)
    max_store_batch_chunks 65536  most chunks reserved by one step
    min_hit_tokens     1      policy hint: a smaller external hit is not loaded (recomputing a
                              short prefix can be cheaper than waiting a step for it)
    host_kernels       true   CUDA: staged copies address the arena from indexed kernels
                              instead of one DMA per small extent (docs/worker.md, "Copies")

Contract: :func:`load_config` raises :class:`~kvserver.errors.InvalidArgument` naming the key
for an unknown key or a bad value (an ``address`` the clients refuse:
:func:`~kvserver.client.common.data_address`), and for a model layout kvserver cannot store
(more than one KV cache group, pipeline parallelism, an unsupported hash algorithm, or a
per-process random hash seed, which would make stored keys useless to every other process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvserver.client.common import data_address
from kvserver.crypto import CLIENT_OPTIONS, ClientSecurity, CurveClient
from kvserver.errors import InvalidArgument
from kvserver.namespace import DTYPE_SIZES, NamespaceSpec
from kvserver.token_file import read_token_file
from scheduler.kv_connector_types import KVConnectorConfig
from worker.config import WorkerConnectorConfig

DEFAULT_ADDRESS = "tcp://127.0.0.1:9471"  # kvserver start's default data plane
#: vLLM's NONE_HASH seed for cryptographic hashes when PYTHONHASHSEED is unset.
VLLM_DEFAULT_SEED = "vllm-none-hash"
#: vLLM ``prefix_caching_hash_algo`` -> kvserver hash algorithm (same bytes, see hashing.py).
HASH_ALGOS = {"sha256": "sha256", "sha256_cbor": "sha256_cbor", "xxhash_cbor": "xxhash_cbor"}

#: the ZMQ client options of docs/security.md (the connector speaks no gRPC: no tls_* keys)
_CURVE_KEYS = tuple(k for k in CLIENT_OPTIONS if k.startswith("curve_"))
_FLOAT_KEYS = ("lookup_timeout_s", "op_timeout_s", "down_backoff_s", "transfer_timeout_s")
_KEYS = {
    "address", "chunk_blocks", "model_id", "lease_s", "colocated", "auth_token",
    "auth_token_file", "max_store_batch_chunks", "min_hit_tokens", "host_kernels",
    "lookup_reuse_s", *_FLOAT_KEYS, *_CURVE_KEYS,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """Everything both halves need: the scheduler and worker connector configurations."""

    spec: NamespaceSpec
    scheduler: KVConnectorConfig
    address: str
    colocated: bool | None
    transfer_timeout_s: float
    auth_token: str
    min_hit_tokens: int = 1
    curve: CurveClient | None = None
    host_kernels: bool = True

    def worker(self, rank: int) -> WorkerConnectorConfig:
        return WorkerConnectorConfig(
            address=self.address, spec=self.spec, rank=rank, colocated=self.colocated,
            timeout_s=self.transfer_timeout_s, auth_token=self.auth_token,
            client_id=f"vllm-worker-{os.getpid()}-r{rank}", curve=self.curve,
            host_kernels=self.host_kernels,
        )  # fmt: skip


def load_config(vllm_config: Any, kv_cache_config: Any) -> PluginConfig:
    """Parse ``kv_transfer_config.kv_connector_extra_config`` and derive the namespace."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = set(extra) - _KEYS
    if unknown:
        raise InvalidArgument(
            f"unknown kv_connector_extra_config keys: {', '.join(sorted(unknown))}",
            valid=", ".join(sorted(_KEYS)),
        )
    address = _get(extra, "address", str, DEFAULT_ADDRESS)
    try:
        data_address(address)  # refused here, naming the key, not by the first client made
    except InvalidArgument as exc:
        raise InvalidArgument(f"kv_connector_extra_config.address: {exc.message}") from None
    chunk_blocks = _get(extra, "chunk_blocks", int, 16)
    floats = {k: float(_get(extra, k, (int, float), d)) for k, d in (
        ("lookup_timeout_s", 0.1), ("op_timeout_s", 1.0), ("down_backoff_s", 5.0),
        ("transfer_timeout_s", 10.0),
    )}  # fmt: skip
    lease = extra.get("lease_s")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int | float)):
        raise InvalidArgument("kv_connector_extra_config.lease_s must be a number or null")
    colocated = extra.get("colocated")
    if colocated is not None and not isinstance(colocated, bool):
        raise InvalidArgument("kv_connector_extra_config.colocated must be true, false or null")
    host_kernels = extra.get("host_kernels", True)
    if not isinstance(host_kernels, bool):
        raise InvalidArgument("kv_connector_extra_config.host_kernels must be true or false")
    auth = _get(extra, "auth_token", str, "")
    token_file = _get(extra, "auth_token_file", str, "")
    if token_file:
        try:
            auth = read_token_file(token_file, "kv_connector_extra_config.auth_token_file")
        except InvalidArgument as exc:
            raise InvalidArgument(exc.message) from None
    for key in _CURVE_KEYS:
        _get(extra, key, str, "")
    try:
        curve = ClientSecurity.from_mapping({k: extra.get(k) for k in _CURVE_KEYS}).curve()
    except InvalidArgument as exc:
        raise InvalidArgument(f"kv_connector_extra_config: {exc.message}") from None
    spec = namespace_spec(vllm_config, kv_cache_config, chunk_blocks, extra.get("model_id"))
    scheduler = KVConnectorConfig(
        address=address, spec=spec, lookup_timeout_s=floats["lookup_timeout_s"],
        lookup_reuse_s=float(_get(extra, "lookup_reuse_s", (int, float), 0.25)),
        op_timeout_s=floats["op_timeout_s"], down_backoff_s=floats["down_backoff_s"],
        lease_s=None if lease is None else float(lease), auth_token=auth, curve=curve,
        client_id=f"vllm-scheduler-{os.getpid()}",
        max_store_batch_chunks=_get(extra, "max_store_batch_chunks", int, 1 << 16),
    )  # fmt: skip
    return PluginConfig(
        spec, scheduler, address, colocated, floats["transfer_timeout_s"], auth,
        min_hit_tokens=_get(extra, "min_hit_tokens", int, 1), curve=curve,
        host_kernels=host_kernels,
    )  # fmt: skip


def namespace_spec(
    vllm_config: Any, kv_cache_config: Any, chunk_blocks: int, model_id: Any = None
) -> NamespaceSpec:
    """The namespace of this vLLM deployment: model, KV dtype and geometry from the KV cache
    spec, vLLM's block size, hash algorithm and NONE_HASH seed, and the TP world size."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise InvalidArgument(
            "kvserver stores models with one KV cache group (no hybrid attention); "
            "start vLLM with --disable-hybrid-kv-cache-manager", groups=len(groups),
        )  # fmt: skip
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise InvalidArgument("pipeline parallelism is not supported by kvserver yet",
                              pipeline_parallel_size=parallel.pipeline_parallel_size)  # fmt: skip
    kv = groups[0].kv_cache_spec
    dtype = str(kv.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise InvalidArgument(f"KV cache dtype {dtype} is not supported")
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if algo not in HASH_ALGOS:
        raise InvalidArgument(
            f"prefix_caching_hash_algo {algo!r} is not supported by kvserver",
            valid=", ".join(HASH_ALGOS),
        )
    tp = parallel.tensor_parallel_size
    model = model_id or vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(model, list):
        model = model[0]
    num_layers = len(groups[0].layer_names)
    heads_per_rank = int(kv.num_kv_heads)
    spec = NamespaceSpec(
        model=str(model), dtype=dtype, num_layers=num_layers,
        num_kv_heads=heads_per_rank * tp, head_dim=int(kv.head_size),
        block_size=int(kv.block_size), chunk_blocks=chunk_blocks, hash_algo=HASH_ALGOS[algo],
        hash_seed=hash_seed(algo), tp_world_size=tp,
    )  # fmt: skip
    page = int(kv.page_size_bytes) * num_layers
    if page != spec.block_bytes:  # MLA latents, padded pages: store the pages as they are
        spec = NamespaceSpec(**{**spec.to_dict(), "part_bytes_override": page * chunk_blocks})
    return spec


def hash_seed(algo: str) -> str:
    """vLLM's NONE_HASH seed, as every process of the deployment resolves it."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        raise InvalidArgument(
            f"with prefix_caching_hash_algo={algo} and no PYTHONHASHSEED, vLLM hashes with a "
            "random per-process seed and no other process could reuse what is stored; set "
            "PYTHONHASHSEED to a shared value or use sha256_cbor"
        )
    return VLLM_DEFAULT_SEED


def _get(extra: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value: Any = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidArgument(f"kv_connector_extra_config.{key} has the wrong type",
                              got=type(value).__name__)  # fmt: skip
    number: Any = value  # an int, a float or a str now
    if key in _FLOAT_KEYS and not number > 0:
        raise InvalidArgument(f"kv_connector_extra_config.{key} must be > 0", got=number)
    if key == "lookup_reuse_s" and not number >= 0:
        raise InvalidArgument(f"kv_connector_extra_config.{key} must be >= 0", got=number)
    if key in ("chunk_blocks", "max_store_batch_chunks", "min_hit_tokens") and number < 1:
        raise InvalidArgument(f"kv_connector_extra_config.{key} must be >= 1", got=number)
    return number
