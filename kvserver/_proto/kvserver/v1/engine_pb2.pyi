# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "max_tokens", "greedy", "cache_salt", "request_id", "priority", "stop_token_ids", "seed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    greedy: bool
    cache_salt: str
    request_id: str
    priority: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., greedy: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class PromptUsage(_message.Message):
    __slots__ = ("prompt_tokens", "gpu_cached_tokens", "kvserver_tokens", "computed_tokens", "num_preemptions")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVSERVER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    gpu_cached_tokens: int
    kvserver_tokens: int
    computed_tokens: int
    num_preemptions: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., gpu_cached_tokens: _Optional[int] = ..., kvserver_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: FinishReason
    usage: PromptUsage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[PromptUsage, _Mapping]] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "address", "up")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    up: bool
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., up: _Optional[bool] = ...) -> None: ...

class EngineStatsResponse(_message.Message):
    __slots__ = ("step", "running", "waiting", "waiting_for_remote_kvs", "free_blocks", "total_blocks", "gpu_cached_blocks", "evicted_blocks", "workers", "workers_error", "kvserver_connector")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_REMOTE_KVS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_ERROR_FIELD_NUMBER: _ClassVar[int]
    KVSERVER_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    step: int
    running: int
    waiting: int
    waiting_for_remote_kvs: int
    free_blocks: int
    total_blocks: int
    gpu_cached_blocks: int
    evicted_blocks: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    workers_error: str
    kvserver_connector: bool
    def __init__(self, step: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_for_remote_kvs: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., gpu_cached_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., workers_error: _Optional[str] = ..., kvserver_connector: _Optional[bool] = ...) -> None: ...
