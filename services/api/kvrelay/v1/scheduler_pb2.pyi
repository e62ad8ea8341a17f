from kvrelay.api.kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole

class SchedulerLoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class SchedulerLoadAdapterResponse(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    def __init__(self, adapter_id: _Optional[int] = ...) -> None: ...

class SchedulerUnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SchedulerUnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "adapter_id", "num_running", "num_waiting")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_id: int
    num_running: int
    num_waiting: int
    def __init__(self, name: _Optional[str] = ..., adapter_id: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "gateway_id", "prompt_token_ids", "params", "priority", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    gateway_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerAbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("gateway_id",)
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    def __init__(self, gateway_id: _Optional[str] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("request_id", "index", "new_token_ids", "logprobs", "finish_reason", "stop_token_id", "error", "num_cached_prompt_tokens", "prompt_logprobs", "embedding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    error: str
    num_cached_prompt_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., error: _Optional[str] = ..., num_cached_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class OutputBatch(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "num_blocks", "block_size", "model", "dtype", "kv_transports", "host_id", "shm_path", "max_model_len", "vocab_size", "eos_token_ids", "compute_domain", "attention_crossover", "instance_id", "num_threads", "kv_address", "kv_group_windows", "kv_cache_dtype", "max_loras", "max_lora_rank", "tensor_parallel_size", "pipeline_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CROSSOVER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    num_blocks: int
    block_size: int
    model: str
    dtype: str
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    shm_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    compute_domain: str
    attention_crossover: int
    instance_id: str
    num_threads: int
    kv_address: str
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    kv_cache_dtype: str
    max_loras: int
    max_lora_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., compute_domain: _Optional[str] = ..., attention_crossover: _Optional[int] = ..., instance_id: _Optional[str] = ..., num_threads: _Optional[int] = ..., kv_address: _Optional[str] = ..., kv_group_windows: _Optional[_Iterable[int]] = ..., kv_cache_dtype: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_blocks", "num_free_blocks", "num_running")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    num_blocks: int
    num_free_blocks: int
    num_running: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "workers", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "model", "max_model_len", "ready", "num_transferring", "adapters", "max_loras")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    model: str
    max_model_len: int
    ready: bool
    num_transferring: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loras: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., ready: _Optional[bool] = ..., num_transferring: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ...) -> None: ...
