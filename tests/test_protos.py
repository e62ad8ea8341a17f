"""The committed gRPC stubs are exactly what `make protos` generates from protos/."""
from __future__ import annotations

from kvrelay.common.protogen import OUTPUT, generate, proto_files


def _tree(root):
    return {path.relative_to(root).as_posix(): path.read_text()
            for path in sorted(root.rglob("*")) if path.is_file() and "__pycache__" not in path.parts}


def test_generated_stubs_are_fresh(tmp_path):
    assert len(proto_files()) >= 6
    generate(tmp_path / "api")
    fresh, committed = _tree(tmp_path / "api"), _tree(OUTPUT)
    stale = sorted(name for name in fresh.keys() | committed.keys()
                   if fresh.get(name) != committed.get(name))
    assert not stale, f"stubs are stale, run `make protos`: {stale}"


def test_stubs_import_and_round_trip():
    from kvrelay.api.kvrelay.v1 import generation_pb2, generation_pb2_grpc

    request = generation_pb2.GenerateRequest(prompt="hi", params={"max_tokens": 3, "seed": 7})
    decoded = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.prompt == "hi" and decoded.params.max_tokens == 3
    assert decoded.params.HasField("seed") and not decoded.params.HasField("temperature")
    assert hasattr(generation_pb2_grpc, "GenerationServicer")
