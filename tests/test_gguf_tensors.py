"""kvrelay's GGUF tensor index (models/gguf_tensors.py) against gguf's own GGUFReader on files
written with gguf's GGUFWriter: the same architecture, tensor names, types, shapes and bytes,
with the metadata values it steps over (strings, arrays of strings and numbers) in front."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from kvrelay.engine.models.gguf_tensors import read_gguf_tensors


def _write(path, alignment: int | None = None) -> None:
    writer = GGUFWriter(str(path), "qwen3")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)] + ["ü", ""])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 17)
    writer.add_uint64("qwen3.context_length", 1 << 40)
    writer.add_bool("general.flag", True)
    rng = np.random.default_rng(0)
    q8 = rng.standard_normal((96, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(q8, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    q4 = rng.standard_normal((32, 128)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quantize(q4, GGMLQuantizationType.Q4_0),
                      raw_dtype=GGMLQuantizationType.Q4_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_index_equals_gguf_readers(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    _write(path, alignment)
    ours, reference = read_gguf_tensors(path), GGUFReader(str(path))
    assert ours.architecture == "qwen3"
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for tensor in reference.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type_name == tensor.tensor_type.name
        assert mine.shape == tuple(int(size) for size in tensor.shape)
        want = np.asarray(tensor.data)
        assert np.array_equal(mine.data, want.view(np.uint8).reshape(mine.data.shape))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_tensors(path)
