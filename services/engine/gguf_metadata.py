"""What kvrelay reads from a GGUF file's metadata itself, around transformers' conversion
(model_loader.py): the architecture, refused before converting where no family of ours builds
it, and the attention head size, which transformers' config mapping reads for some
architectures only (not for qwen3: every Qwen3 file would get Qwen3Config's head_dim of 128).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# llama.cpp's general.architecture -> the model_type transformers converts it to
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    architecture: str  # general.architecture, the prefix of the model's keys
    key_length: int | None  # <arch>.attention.key_length: the q/k head size, where written

    @classmethod
    def read(cls, gguf_path: Path) -> "GGUFMetadata":
        # one parse: GGUFReader reads every key, the tokenizer's 10^5 strings included (seconds)
        from gguf import GGUFReader
        fields = GGUFReader(str(gguf_path)).fields
        architecture = fields["general.architecture"].contents()
        key_length = fields.get(f"{architecture}.attention.key_length")
        return cls(architecture, None if key_length is None else int(key_length.contents()))


def supported_gguf_architectures() -> list[str]:
    from kvrelay.engine.models.registry import BY_MODEL_TYPE
    return sorted(arch for arch, model_type in GGUF_MODEL_TYPES.items()
                  if model_type in BY_MODEL_TYPE)


def check_supported(metadata: GGUFMetadata, gguf_path: Path) -> None:
    """ValueError naming the supported architectures, where no family of ours builds the file's."""
    if metadata.architecture not in supported_gguf_architectures():
        raise ValueError(f"{gguf_path}: GGUF architecture {metadata.architecture!r} is not "
                         f"supported; kvrelay serves GGUF architectures "
                         f"{', '.join(supported_gguf_architectures())}")


def complete_config_(config, metadata: GGUFMetadata) -> None:
    """Set on transformers' config (read from the file) what its mapping skipped: head_dim from
    the key length, where the config has a head_dim."""
    if metadata.key_length is not None and getattr(config, "head_dim", None) is not None:
        config.head_dim = metadata.key_length
