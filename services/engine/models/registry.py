"""Which family builds a checkpoint: chosen by `architectures` in its config.json (by
`model_type` where a config names no architecture, as GGUF conversions may not)."""
from __future__ import annotations

from types import ModuleType

from kvrelay.engine.models import gemma2, gemma3, llama, mixtral, phi3, qwen3, qwen3_moe
from kvrelay.engine.models.arch import ArchSpec

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3, qwen3_moe, mixtral, gemma2, gemma3, phi3)
BY_ARCHITECTURE = {name: family for family in FAMILIES for name in family.ARCHITECTURES}
BY_MODEL_TYPE = {model_type: family for family in FAMILIES
                 for model_type in family.ARCHITECTURES.values()}


def supported_architectures() -> list[str]:
    return sorted(BY_ARCHITECTURE)


def family_of(config: dict) -> ModuleType:
    """config: config.json's contents. Raises ValueError naming what is supported."""
    names = config.get("architectures") or []
    for name in names:
        if name in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[name]
    if not names and config.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[config["model_type"]]
    found = ", ".join(names) if names else f"model_type {config.get('model_type')!r}"
    raise ValueError(f"architecture {found} is not supported; kvrelay serves "
                     f"{', '.join(supported_architectures())}")


def arch_spec(hf_config) -> tuple[ModuleType, ArchSpec]:
    family = family_of(hf_config.to_dict())
    return family, family.spec(hf_config)


def build_model(hf_config, tp=None, stage_layers: range | None = None,
                expert_parallel: bool = False):
    """The family's DecoderLM (on whatever device is current; under tensor parallelism, this
    rank's shard of it, its experts whole with expert_parallel; for a pipeline stage, its
    layers) and its checkpoint renamer."""
    from kvrelay.engine.models.decoder import DecoderLM
    from kvrelay.engine.parallel.group import TPGroup
    from kvrelay.engine.parallel.shard import check_shardable, local_spec
    tp = tp or TPGroup()
    family, spec = arch_spec(hf_config)
    check_shardable(spec, tp.size, expert_parallel)
    return (DecoderLM(hf_config, local_spec(spec, tp.size, tp.rank, expert_parallel), tp,
                      stage_layers),
            getattr(family, "rename", lambda name: name))
