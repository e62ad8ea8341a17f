"""The peer scripts' pure parts: where they live, what they run, the model dir they serve."""
from __future__ import annotations

import json

from benchmarks.peers import common, hf_transformers, llama_server


def test_peers_home_follows_the_flag_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_PEERS_HOME", str(tmp_path / "env"))
    assert common.peers_home() == tmp_path / "env"
    assert common.peers_home(tmp_path / "flag") == tmp_path / "flag"
    assert (tmp_path / "flag").is_dir()


def test_llama_server_serves_with_16_slots_on_2_threads(tmp_path):
    line = llama_server.command(tmp_path / "llama-server", 8080, tmp_path / "model.gguf")
    assert line[line.index("-m") + 1] == str(tmp_path / "model.gguf")
    assert line[line.index("--parallel") + 1] == "16"
    assert line[line.index("-t") + 1] == "2" and line[line.index("-tb") + 1] == "2"
    assert int(line[line.index("-c") + 1]) == 16 * llama_server.CONTEXT_PER_SLOT
    assert "--no-repack" not in line and "--host" in line
    assert "--no-repack" in llama_server.command(tmp_path / "x", 1, tmp_path / "m",
                                                 repack=False)


def test_llama_servers_default_build_is_the_fair_one_without_amx():
    fair = llama_server.BUILDS[llama_server.DEFAULT_BUILD]
    assert fair.repack and fair.weights == "Q4_0" and "llama-quantize" in fair.targets
    flags = fair.cmake_flags
    assert "-DGGML_NATIVE=OFF" in flags and "-DCMAKE_BUILD_TYPE=Release" in flags
    have = llama_server.cpu_flags()
    for name, need in llama_server.SIMD_OPTIONS.items():  # as this machine has them
        assert f"-DGGML_{name}={'ON' if need in have else 'OFF'}" in flags
    for name in ("AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{name}=OFF" in flags
    native = llama_server.BUILDS["native"]
    assert "-DGGML_NATIVE=ON" in native.cmake_flags and not native.repack
    assert native.folder != fair.folder


def test_llama_servers_q4_0_is_made_from_the_converted_model_in_its_home(tmp_path):
    binary = tmp_path / "build" / "bin" / "llama-server"
    recipe = llama_server.weights_recipe(tmp_path, "1.0", binary, tmp_path / "model-dir", 2)
    convert, quantize = recipe["commands"]
    assert convert[1].endswith("llama.cpp/convert_hf_to_gguf.py")
    assert convert[2:5] == [str(tmp_path / "model-dir"), "--outtype", "bf16"]
    assert quantize[:2] == [str(binary.parent / "llama-quantize"), convert[-1]]
    assert quantize[2:4] == [recipe["file"], "Q4_0"]
    assert recipe["file"].startswith(str(tmp_path / "llama-cpp-1.0" / "weights"))
    assert "torch==2.13.0" in llama_server.CONVERTER_PACKAGES


def test_transformers_serve_gets_the_converted_weights_with_an_architecture(tmp_path):
    folder = hf_transformers.serve_model_dir(tmp_path)
    source = hf_transformers.model_dir()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (folder / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    assert hf_transformers.serve_model_dir(tmp_path) == folder  # idempotent
    command = hf_transformers.serve_command(tmp_path / "venv" / "bin" / "python", 8090,
                                            "bfloat16", tmp_path)
    assert command[1:3] == ["serve", str(folder)] and "--continuous-batching" in command


def test_vllm_cpu_serves_the_converted_weights_offline_on_the_same_cpus(tmp_path):
    from benchmarks.peers import vllm_cpu
    python = tmp_path / "venv" / "bin" / "python"
    line = vllm_cpu.serve_command(python, 8100, "bfloat16", tmp_path)
    assert line[:2] == [str(tmp_path / "venv" / "bin" / "vllm"), "serve"]
    assert line[2] == str(hf_transformers.serve_model_dir(tmp_path))
    assert line[line.index("--dtype") + 1] == "bfloat16" and "127.0.0.1" in line
    env = vllm_cpu.serve_env(threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["HF_HUB_OFFLINE"] == "1"
    assert vllm_cpu.serve_env(threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_the_fair_llama_build_turns_on_only_the_extensions_this_cpu_has(tmp_path):
    """A build with an extension the CPU lacks dies with SIGILL (AVX-VNNI on a machine with
    only AVX512-VNNI did); each set of extensions gets its own build folder."""
    from benchmarks.peers import llama_server
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c bmi2 avx512f "
                       "avx512vbmi avx512_vnni avx512_bf16 amx_tile\n")
    flags = llama_server.cpu_flags(str(cpuinfo))
    built = llama_server.fair_ggml_flags(flags)
    assert "-DGGML_AVX_VNNI=OFF" in built and "-DGGML_AVX512_VNNI=ON" in built
    assert "-DGGML_AVX512_VBMI=ON" in built and "-DGGML_AMX_TILE=OFF" in built
    assert "-DGGML_NATIVE=OFF" in built
    assert llama_server.fair_ggml_flags(set()).count("-DGGML_AVX=OFF") == 1
