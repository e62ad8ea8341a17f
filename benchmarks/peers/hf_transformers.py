"""HF transformers as a peer, in its own venv: `transformers serve --continuous-batching` and
static batching with `model.generate` (benchmarks/peers/hf_static.py, run in that venv).

    python -m benchmarks.peers.hf_transformers install [--home DIR]
    python -m benchmarks.peers.hf_transformers serve [--port 8090] [--dtype bfloat16] [--model DIR]

The venv gets the CPU build of torch pinned like the project's (an unpinned torch pulls CUDA)
and `transformers[serving]`. Both load the directory kvrelay converts the default GGUF into
(dequantized safetensors + tokenizer), so every system runs the same weights, offline.
`transformers serve` rejects request fields it does not know (422), so `bench serve` talks to it
with `--backend transformers` (min_new_tokens in its generation_config instead of ignore_eos).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.peers.common import (Server, ensure_venv, install_or_serve, peers_home, run,
                                     start_process, wait_until_serving)
from kvrelay.bench.prompts import chat64

TORCH = "torch==2.13.0"
# The model types kvrelay serves, and their transformers class.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
TRANSFORMERS = "5.24.0"  # the version the project's own numbers were measured against
REPO = Path(__file__).resolve().parents[2]


def install(home: str | Path | None = None, version: str = TRANSFORMERS) -> Path:
    """The venv's python, with torch and transformers[serving] installed once."""
    folder = peers_home(home) / f"transformers-{version}"
    python = ensure_venv(folder)
    stamp = folder / ".installed"
    if not stamp.exists():
        run([str(python), "-m", "pip", "install", "-q", TORCH,
             f"transformers[serving]=={version}", "accelerate"])
        stamp.write_text(version)
    return python


def model_dir() -> Path:
    # kvrelay's converted copy of the default GGUF (converted on first use).
    from kvrelay.engine.model_loader import resolve_model_dir
    return resolve_model_dir(None)


def serve_model_dir(home: str | Path | None = None) -> Path:
    """The converted weights as `transformers serve` wants them: its loader picks the class
    from config.json's "architectures", which a config rebuilt from GGUF metadata lacks. The
    weights and tokenizer are linked, not copied; only config.json gets the field."""
    source = model_dir()
    target = peers_home(home) / "serve-model" / source.name
    if (target / "config.json").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json" and not (target / path.name).exists():
            (target / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config.setdefault("architectures", [ARCHITECTURES[config["model_type"]]])
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def versions(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import torch, transformers; "
                          "print(f'transformers {transformers.__version__}, torch "
                          "{torch.__version__}')"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def offline_env(threads: int) -> dict:
    # Nothing may be downloaded; the thread count is set like the other systems'.
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads)}


def serve_command(python: Path, port: int, dtype: str, home=None,
                  model: Path | None = None) -> list[str]:
    return [str(python.parent / "transformers"), "serve", str(model or serve_model_dir(home)),
            "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--device", "cpu", "--log-level", "warning"]


def launch_serve(port: int, log_path: Path, home=None, dtype: str = "bfloat16",
                 threads: int = 2, timeout_s: float = 600, model: Path | None = None) -> Server:
    python = install(home)
    command = serve_command(python, port, dtype, home, model)
    process = start_process(command, log_path, offline_env(threads))
    server = Server("transformers serve --continuous-batching", process,
                    f"http://127.0.0.1:{port}", "transformers", command,
                    {"version": versions(python), "dtype": dtype, "threads": threads})
    # The model loads at start (it is forced); /v1/models answers once the app is up.
    wait_until_serving(process, f"{server.base_url}/v1/models", timeout_s, log_path)
    return server


def static_command(python: Path, dtype: str, threads: int, batch_size: int, out: Path,
                   max_requests: int | None, max_tokens: int,
                   model: Path | None = None) -> list[str]:
    """hf_static.py's command; chat-64's conversations are written beside `out` first, since
    the peer's venv cannot import kvrelay to generate them."""
    conversations = out.with_name("conversations.json")
    conversations.write_text(json.dumps(chat64(0)[:max_requests]))
    return [str(python), str(REPO / "benchmarks" / "peers" / "hf_static.py"),
            "--model-dir", str(model or model_dir()), "--dtype", dtype, "--threads", str(threads),
            "--batch-size", str(batch_size), "--max-tokens", str(max_tokens),
            "--conversations", str(conversations), "--json", str(out)]


def main() -> None:
    install_or_serve(__doc__.splitlines()[0], 8090, install, versions, serve_command,
                     offline_env)


if __name__ == "__main__":
    main()
