"""A GGUF file's tensor index and data, without building its metadata values.

gguf's GGUFReader turns every metadata value into numpy views, the tokenizer's ~10^5 strings
included: 3.6 s for the default model's file, on every model load that reads its 4-bit blocks
(twice: the layers' and the head's). Here the metadata is stepped over (a string is a length
and its bytes), only `general.architecture` and `general.alignment` kept, and each tensor's
data is a view of one memory map, shaped as GGUFReader shapes block-quantized tensors: [rows...,
bytes of a row] uint8 (for every type here).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> their size in bytes (STRING = 8 and ARRAY = 9 are read apart)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType's name: "Q4_0", "Q8_0", "F32"...
    shape: tuple[int, ...]  # GGUF's order: shape[0] is the row length (columns)
    data: np.ndarray  # [rows..., bytes of a row] uint8, whatever the type


@dataclass(frozen=True, slots=True)
class GGUFTensors:
    architecture: str
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buffer, offset: int = 0) -> None:
        self.buffer, self.offset = buffer, offset

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        text = bytes(self.buffer[self.offset:self.offset + length]).decode("utf-8")
        self.offset += length
        return text

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.unpack("Q")  # the cursor is past the length now
            self.offset += length
        elif value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALAR_BYTES:
                self.offset += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        elif value_type in _SCALAR_BYTES:
            self.offset += _SCALAR_BYTES[value_type]
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")


def read_gguf_tensors(path: str | Path) -> GGUFTensors:
    """The file's architecture and tensors; ValueError where it is not a GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(raw[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor = _Cursor(raw, 4)
    _version, num_tensors, num_keys = cursor.unpack("IQQ")
    architecture, alignment = "", DEFAULT_ALIGNMENT
    for _ in range(num_keys):
        key, value_type = cursor.string(), cursor.unpack("I")
        if key == "general.architecture" and value_type == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and value_type == _UINT32:
            alignment = cursor.unpack("I")
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.unpack("I")
        shape = tuple(cursor.unpack("Q") for _ in range(num_dims))
        type_id, offset = cursor.unpack("IQ")
        infos.append((name, shape, GGMLQuantizationType(type_id), offset))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        rows = tuple(reversed(shape[1:]))
        row_bytes = shape[0] // block_size * block_bytes
        start = data_start + offset
        nbytes = int(np.prod(rows, dtype=np.int64)) * row_bytes
        data = raw[start:start + nbytes].reshape(*rows, row_bytes)
        tensors[name] = GGUFTensor(name, qtype.name, shape, data)
    return GGUFTensors(architecture, tensors)
