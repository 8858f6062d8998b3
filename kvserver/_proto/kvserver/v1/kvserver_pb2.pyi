# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_CPU: _ClassVar[Medium]
    MEDIUM_STORAGE: _ClassVar[Medium]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_CPU: Medium
MEDIUM_STORAGE: Medium

class TokenPrefix(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "lora", "packed_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora: LoraAdapter
    packed_token_ids: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., packed_token_ids: _Optional[bytes] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class KeyPrefix(_message.Message):
    __slots__ = ("keys", "packed_keys", "key_size")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_keys: bytes
    key_size: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., packed_keys: _Optional[bytes] = ..., key_size: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: TokenPrefix
    keys: KeyPrefix
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenPrefix, _Mapping]] = ..., keys: _Optional[_Union[KeyPrefix, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("namespace_id", "hit_chunks", "hit_tokens", "num_chunks", "chunk_tokens", "tiers")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    hit_chunks: int
    hit_tokens: int
    num_chunks: int
    chunk_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierHits]
    def __init__(self, namespace_id: _Optional[str] = ..., hit_chunks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierHits, _Mapping]]] = ...) -> None: ...

class TierHits(_message.Message):
    __slots__ = ("tier", "chunks", "tokens")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    chunks: int
    tokens: int
    def __init__(self, tier: _Optional[str] = ..., chunks: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ScoreHostsRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "keys", "candidate_hosts", "tier_weights", "exact")
    class TierWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_HOSTS_FIELD_NUMBER: _ClassVar[int]
    TIER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: TokenPrefix
    keys: KeyPrefix
    candidate_hosts: _containers.RepeatedScalarFieldContainer[str]
    tier_weights: _containers.ScalarMap[str, float]
    exact: bool
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenPrefix, _Mapping]] = ..., keys: _Optional[_Union[KeyPrefix, _Mapping]] = ..., candidate_hosts: _Optional[_Iterable[str]] = ..., tier_weights: _Optional[_Mapping[str, float]] = ..., exact: _Optional[bool] = ...) -> None: ...

class ScoreHostsResponse(_message.Message):
    __slots__ = ("namespace_id", "num_chunks", "chunk_tokens", "hosts")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    num_chunks: int
    chunk_tokens: int
    hosts: _containers.RepeatedCompositeFieldContainer[HostScore]
    def __init__(self, namespace_id: _Optional[str] = ..., num_chunks: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., hosts: _Optional[_Iterable[_Union[HostScore, _Mapping]]] = ...) -> None: ...

class HostScore(_message.Message):
    __slots__ = ("host_id", "data_address", "grpc_address", "hit_chunks", "hit_tokens", "tiers", "score")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    data_address: str
    grpc_address: str
    hit_chunks: int
    hit_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierHits]
    score: float
    def __init__(self, host_id: _Optional[str] = ..., data_address: _Optional[str] = ..., grpc_address: _Optional[str] = ..., hit_chunks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierHits, _Mapping]]] = ..., score: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("server_version", "host_id", "tiers", "namespaces", "num_leases", "event_log_id", "events_last_seq", "events_oldest_seq", "cluster")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    EVENT_LOG_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_OLDEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    host_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    num_leases: int
    event_log_id: str
    events_last_seq: int
    events_oldest_seq: int
    cluster: ClusterStats
    def __init__(self, server_version: _Optional[str] = ..., host_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., num_leases: _Optional[int] = ..., event_log_id: _Optional[str] = ..., events_last_seq: _Optional[int] = ..., events_oldest_seq: _Optional[int] = ..., cluster: _Optional[_Union[ClusterStats, _Mapping]] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("condition", "condition_detail", "url", "host_id", "incarnation", "live_hosts", "pending_keys", "registrations", "resyncs", "heartbeats", "batches", "commands", "indexed_keys", "errors", "dropped_keys", "index_losses", "resync_pending", "resync_in_s", "redis_full", "deferred_keys", "bad_records", "unreadable_sets")
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    CONDITION_DETAIL_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LIVE_HOSTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_KEYS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_KEYS_FIELD_NUMBER: _ClassVar[int]
    INDEX_LOSSES_FIELD_NUMBER: _ClassVar[int]
    RESYNC_PENDING_FIELD_NUMBER: _ClassVar[int]
    RESYNC_IN_S_FIELD_NUMBER: _ClassVar[int]
    REDIS_FULL_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_KEYS_FIELD_NUMBER: _ClassVar[int]
    BAD_RECORDS_FIELD_NUMBER: _ClassVar[int]
    UNREADABLE_SETS_FIELD_NUMBER: _ClassVar[int]
    condition: str
    condition_detail: str
    url: str
    host_id: str
    incarnation: str
    live_hosts: int
    pending_keys: int
    registrations: int
    resyncs: int
    heartbeats: int
    batches: int
    commands: int
    indexed_keys: int
    errors: int
    dropped_keys: int
    index_losses: int
    resync_pending: int
    resync_in_s: float
    redis_full: int
    deferred_keys: int
    bad_records: int
    unreadable_sets: int
    def __init__(self, condition: _Optional[str] = ..., condition_detail: _Optional[str] = ..., url: _Optional[str] = ..., host_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., live_hosts: _Optional[int] = ..., pending_keys: _Optional[int] = ..., registrations: _Optional[int] = ..., resyncs: _Optional[int] = ..., heartbeats: _Optional[int] = ..., batches: _Optional[int] = ..., commands: _Optional[int] = ..., indexed_keys: _Optional[int] = ..., errors: _Optional[int] = ..., dropped_keys: _Optional[int] = ..., index_losses: _Optional[int] = ..., resync_pending: _Optional[int] = ..., resync_in_s: _Optional[float] = ..., redis_full: _Optional[int] = ..., deferred_keys: _Optional[int] = ..., bad_records: _Optional[int] = ..., unreadable_sets: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "medium", "policy", "capacity_bytes", "used_bytes", "pinned_bytes", "reserved_bytes", "entries", "hit_chunks", "miss_chunks", "evicted_chunks", "stored_chunks", "loaded_chunks", "lookups", "condition", "condition_detail", "corrupt_chunks", "recovered_chunks", "promoted_chunks", "io_errors", "skipped_chunks", "io_mode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MISS_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STORED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    CONDITION_DETAIL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    IO_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    IO_MODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    medium: Medium
    policy: str
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    entries: int
    hit_chunks: int
    miss_chunks: int
    evicted_chunks: int
    stored_chunks: int
    loaded_chunks: int
    lookups: int
    condition: str
    condition_detail: str
    corrupt_chunks: int
    recovered_chunks: int
    promoted_chunks: int
    io_errors: int
    skipped_chunks: int
    io_mode: str
    def __init__(self, name: _Optional[str] = ..., medium: _Optional[_Union[Medium, str]] = ..., policy: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hit_chunks: _Optional[int] = ..., miss_chunks: _Optional[int] = ..., evicted_chunks: _Optional[int] = ..., stored_chunks: _Optional[int] = ..., loaded_chunks: _Optional[int] = ..., lookups: _Optional[int] = ..., condition: _Optional[str] = ..., condition_detail: _Optional[str] = ..., corrupt_chunks: _Optional[int] = ..., recovered_chunks: _Optional[int] = ..., promoted_chunks: _Optional[int] = ..., io_errors: _Optional[int] = ..., skipped_chunks: _Optional[int] = ..., io_mode: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model", "entries", "bytes", "lookups", "hit_chunks", "miss_chunks", "stored_chunks", "loaded_chunks", "evicted_chunks", "rolled_back_chunks", "filtered_chunks", "store_rejections", "expired_leases", "tiers")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MISS_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STORED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STORE_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    model: str
    entries: int
    bytes: int
    lookups: int
    hit_chunks: int
    miss_chunks: int
    stored_chunks: int
    loaded_chunks: int
    evicted_chunks: int
    rolled_back_chunks: int
    filtered_chunks: int
    store_rejections: int
    expired_leases: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    def __init__(self, namespace_id: _Optional[str] = ..., model: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., hit_chunks: _Optional[int] = ..., miss_chunks: _Optional[int] = ..., stored_chunks: _Optional[int] = ..., loaded_chunks: _Optional[int] = ..., evicted_chunks: _Optional[int] = ..., rolled_back_chunks: _Optional[int] = ..., filtered_chunks: _Optional[int] = ..., store_rejections: _Optional[int] = ..., expired_leases: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "entries", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    entries: int
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "chunk_blocks", "hash_algo", "hash_seed", "tp_world_size", "kv_factor", "part_bytes_override", "label")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    chunk_blocks: int
    hash_algo: str
    hash_seed: str
    tp_world_size: int
    kv_factor: int
    part_bytes_override: int
    label: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., chunk_blocks: _Optional[int] = ..., hash_algo: _Optional[str] = ..., hash_seed: _Optional[str] = ..., tp_world_size: _Optional[int] = ..., kv_factor: _Optional[int] = ..., part_bytes_override: _Optional[int] = ..., label: _Optional[str] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("namespace_id", "spec", "part_bytes", "key_size", "chunk_tokens")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    spec: NamespaceSpec
    part_bytes: int
    key_size: int
    chunk_tokens: int
    def __init__(self, namespace_id: _Optional[str] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., part_bytes: _Optional[int] = ..., key_size: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[Namespace]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[Namespace, _Mapping]]] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "log_id")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    log_id: str
    def __init__(self, from_seq: _Optional[int] = ..., log_id: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "log_id", "namespace_id", "medium", "block_stored", "block_removed", "all_blocks_cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    log_id: str
    namespace_id: str
    medium: Medium
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., log_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., medium: _Optional[_Union[Medium, str]] = ..., block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "keys", "ttl_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: TokenPrefix
    keys: KeyPrefix
    ttl_s: float
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenPrefix, _Mapping]] = ..., keys: _Optional[_Union[KeyPrefix, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned_chunks", "num_chunks")
    PINNED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    pinned_chunks: int
    num_chunks: int
    def __init__(self, pinned_chunks: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: TokenPrefix
    keys: KeyPrefix
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenPrefix, _Mapping]] = ..., keys: _Optional[_Union[KeyPrefix, _Mapping]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("unpinned_chunks", "num_chunks")
    UNPINNED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    unpinned_chunks: int
    num_chunks: int
    def __init__(self, unpinned_chunks: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...
