from kvrelay.api.kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("prompt", "chat", "add_special_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatRender
    add_special_tokens: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatRender, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class ChatRender(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "reasoning_effort")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    reasoning_effort: str
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ..., reasoning_effort: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids", "tool_call_format")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tool_call_format: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tool_call_format: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DetokenizeItem(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "finished", "skip_special_tokens", "prompt_tail_token_ids", "piece_token_ids", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIECE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    skip_special_tokens: bool
    prompt_tail_token_ids: _containers.RepeatedScalarFieldContainer[int]
    piece_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_tail_token_ids: _Optional[_Iterable[int]] = ..., piece_token_ids: _Optional[_Iterable[int]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DetokenizeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DetokenizeItem, _Mapping]]] = ...) -> None: ...

class DetokenizeResult(_message.Message):
    __slots__ = ("request_id", "text", "pieces")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    pieces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., pieces: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeBatchResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DetokenizeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DetokenizeResult, _Mapping]]] = ...) -> None: ...
