from kvrelay.api.kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "name", "path")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    name: str
    path: str
    def __init__(self, adapter_id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    def __init__(self, adapter_id: _Optional[int] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "params", "block_ids", "num_computed_tokens", "eos_token_ids", "child_index", "num_prompt_tokens", "group_block_counts", "adapter_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHILD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    child_index: int
    num_prompt_tokens: int
    group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: int
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., child_index: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., group_block_counts: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[int] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "num_new_tokens", "new_block_ids", "new_token_ids", "token_bitmask", "draft_token_ids", "group_block_counts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_new_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bitmask: bytes
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., num_new_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., token_bitmask: _Optional[bytes] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., group_block_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class KvSendOrder(_message.Message):
    __slots__ = ("transfer_id", "seq_id", "src_block_ids", "dst_address", "dst_block_ids", "transport", "dst_shm_path", "during_step", "deadline_unix_ms", "dst_instance_id", "dst_kv_shards")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DST_SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    DURING_STEP_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_KV_SHARDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    seq_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_address: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: str
    dst_shm_path: str
    during_step: bool
    deadline_unix_ms: int
    dst_instance_id: str
    dst_kv_shards: int
    def __init__(self, transfer_id: _Optional[str] = ..., seq_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_address: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., transport: _Optional[str] = ..., dst_shm_path: _Optional[str] = ..., during_step: _Optional[bool] = ..., deadline_unix_ms: _Optional[int] = ..., dst_instance_id: _Optional[str] = ..., dst_kv_shards: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_sequences", "scheduled", "finished_seq_ids", "kv_sends", "num_threads")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SENDS_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_sends: _containers.RepeatedCompositeFieldContainer[KvSendOrder]
    num_threads: int
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[str]] = ..., kv_sends: _Optional[_Iterable[_Union[KvSendOrder, _Mapping]]] = ..., num_threads: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_ids", "logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class KvSendResult(_message.Message):
    __slots__ = ("transfer_id", "ok", "error", "num_bytes", "seconds")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    ok: bool
    error: str
    num_bytes: int
    seconds: float
    def __init__(self, transfer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PromptLogprobChunk(_message.Message):
    __slots__ = ("seq_id", "first_position", "entries")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    first_position: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, seq_id: _Optional[str] = ..., first_position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("seq_id", "values")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "kv_sends", "prompt_logprobs", "pooled")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    KV_SENDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    kv_sends: _containers.RepeatedCompositeFieldContainer[KvSendResult]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobChunk]
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., kv_sends: _Optional[_Iterable[_Union[KvSendResult, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobChunk, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ...) -> None: ...
