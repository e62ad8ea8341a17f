"""The peer scripts' pure parts: where they live, what they run, the model dir they serve."""
from __future__ import annotations

import json

from benchmarks.peers import common, hf_transformers, llama_server
from services.engine.model_loader import default_gguf_path


def test_peers_home_follows_the_flag_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_PEERS_HOME", str(tmp_path / "env"))
    assert common.peers_home() == tmp_path / "env"
    assert common.peers_home(tmp_path / "flag") == tmp_path / "flag"
    assert (tmp_path / "flag").is_dir()


def test_llama_server_serves_kvrelays_gguf_with_16_slots_on_2_threads(tmp_path):
    line = llama_server.command(tmp_path / "llama-server", 8080)
    assert line[line.index("-m") + 1] == str(default_gguf_path())
    assert line[line.index("--parallel") + 1] == "16"
    assert line[line.index("-t") + 1] == "2" and line[line.index("-tb") + 1] == "2"
    assert int(line[line.index("-c") + 1]) == 16 * llama_server.CONTEXT_PER_SLOT
    assert "--no-repack" in line and "--host" in line
    assert "--no-repack" not in llama_server.command(tmp_path / "x", 1, repack=True)
    assert "-DGGML_NATIVE=ON" in llama_server.CMAKE_FLAGS


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
