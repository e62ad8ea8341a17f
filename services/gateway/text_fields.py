"""Every string of a request with the path of its field ("messages.0.content"), for the text
checks of limits.py: in a parsed REST body (pydantic models, JSON values). The public gRPC API's
messages have theirs in proto_text_fields.py."""
from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel

Texts = Iterator[tuple[str, str]]


def join_path(path: str, name: object) -> str:
    return f"{path}.{name}" if path else str(name)


def json_texts(value, path: str = "") -> Texts:
    """The strings of a pydantic model (the fields the body set, not defaults) or of plain
    JSON values (object keys included)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        given = value.model_fields_set
        for name, field in type(value).model_fields.items():
            if name in given:
                yield from json_texts(getattr(value, name), join_path(path, field.alias or name))
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield path, key
            yield from json_texts(item, join_path(path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from json_texts(item, join_path(path, index))
