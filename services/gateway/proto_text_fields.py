"""Every string of a protobuf message with the path of its field ("chat.messages.0.content"),
for the text checks of limits.py on the public gRPC API; and, for a message that did not parse,
which string field is not UTF-8. The gRPC edge's counterpart of text_fields.py."""
from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from kvrelay.gateway.text_fields import Texts, join_path


def proto_texts(message: Message, path: str = "") -> Texts:
    """The set string fields of a protobuf message, nested messages included."""
    for field, value in message.ListFields():
        name = join_path(path, field.name)
        if field.type == FieldDescriptor.TYPE_STRING:
            if field.is_repeated:
                yield from ((join_path(name, index), text) for index, text in enumerate(value))
            else:
                yield name, value
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if _is_map(field):
                yield from _map_texts(field, value, name)
            elif field.is_repeated:
                for index, item in enumerate(value):
                    yield from proto_texts(item, join_path(name, index))
            else:
                yield from proto_texts(value, name)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _map_texts(field: FieldDescriptor, entries, path: str) -> Texts:
    key_field, value_field = field.message_type.fields_by_name["key"], \
        field.message_type.fields_by_name["value"]
    for key, value in entries.items():
        if key_field.type == FieldDescriptor.TYPE_STRING:
            yield path, key
        if value_field.type == FieldDescriptor.TYPE_STRING:
            yield join_path(path, key), value
        elif value_field.type == FieldDescriptor.TYPE_MESSAGE:
            yield from proto_texts(value, join_path(path, key))


# ---- a serialized message that protobuf refused --------------------------------------------------
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def undecodable_string_field(descriptor: Descriptor, data: bytes, path: str = "") -> str | None:
    """The path of the first string field of `data` (a serialized `descriptor` message) whose
    bytes are not UTF-8, or None (also when the wire format itself is corrupt). protobuf only
    says "String field had bad UTF-8"; this walks the wire format to name the field."""
    try:
        return _find_undecodable(descriptor, data, path)
    except IndexError:  # truncated
        return None


def _find_undecodable(descriptor: Descriptor, data: bytes, path: str) -> str | None:
    position, counts = 0, {}
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, position = _varint(data, position)
        elif wire_type == _FIXED64:
            position += 8
        elif wire_type == _FIXED32:
            position += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _varint(data, position)
            chunk, position = data[position:position + length], position + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = counts[number] = counts.get(number, -1) + 1
            name = join_path(path, field.name)
            if field.is_repeated and not _is_map(field):
                name = join_path(name, index)
            found = _undecodable_in(field, chunk, name)
            if found is not None:
                return found
        else:  # groups, or not protobuf at all
            return None
    return None


def _undecodable_in(field: FieldDescriptor, chunk: bytes, name: str) -> str | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return name
        return None
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _find_undecodable(field.message_type, chunk, name)
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
