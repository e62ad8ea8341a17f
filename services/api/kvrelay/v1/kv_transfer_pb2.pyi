from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KvChunk(_message.Message):
    __slots__ = ("transfer_id", "layer", "dst_block_ids", "keys", "values", "dtype", "last", "deadline_unix_ms", "dst_instance_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    values: bytes
    dtype: str
    last: bool
    deadline_unix_ms: int
    dst_instance_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., dtype: _Optional[str] = ..., last: _Optional[bool] = ..., deadline_unix_ms: _Optional[int] = ..., dst_instance_id: _Optional[str] = ...) -> None: ...

class KvPushAck(_message.Message):
    __slots__ = ("transfer_id", "ok", "error", "num_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    ok: bool
    error: str
    num_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...
