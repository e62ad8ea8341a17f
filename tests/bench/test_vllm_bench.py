"""benchmarks.vllm_bench without servers: the client's command line per workload, and the
report's ratios (each round's, oriented so that above 1 is better for the first system)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import vllm_bench


def _args(*argv: str):
    return vllm_bench.parse_args(["--out", "/tmp/unused", *argv])


def test_workloads_and_systems_are_checked():
    with pytest.raises(SystemExit):
        _args("--workloads", "random,burstgpt")
    with pytest.raises(SystemExit):
        _args("--workloads", "sharegpt")  # no file: nothing is downloaded
    with pytest.raises(SystemExit):
        _args("--systems", "kvrelay-pd,sglang")
    args = _args("--systems", "kvrelay-pd@shared-compute-steps=serialize,vllm-cpu")
    assert args.workloads == ["random", "prefix_repetition"]
    mixed = vllm_bench.WORKLOAD_FLAGS["random-mixed"]
    assert mixed[mixed.index("--random-range-ratio") + 1] == '{"input": 0.5, "output": 0.75}'


def test_the_client_command_names_the_workload_goodput_and_result(monkeypatch):
    monkeypatch.setattr(vllm_bench.vllm_cpu, "install", lambda home: Path("/venv/bin/python"))
    args = _args("--model", "/models/x", "--goodput", "ttft:1000 tpot:50")
    command = vllm_bench.bench_command(args, "http://127.0.0.1:9", "x",
                                       vllm_bench.WORKLOAD_FLAGS["prefix_repetition"],
                                       Path("/out/prefix_repetition.json"), seed=3)
    text = " ".join(command)
    assert command[:3] == ["/venv/bin/vllm", "bench", "serve"]
    assert "--tokenizer /models/x" in text and "--ignore-eos" in text
    assert "--prefix-repetition-prefix-len 1024" in text and "--max-concurrency 16" in text
    assert "--goodput ttft:1000 tpot:50" in text and "--save-detailed" in text
    assert "--result-dir /out --result-filename prefix_repetition.json" in text
    sharegpt = vllm_bench.bench_command(_args("--workloads", "sharegpt", "--sharegpt-path",
                                              "/data/sg.json", "--model", "/m"),
                                        "u", "m", vllm_bench.WORKLOAD_FLAGS["sharegpt"],
                                        None, seed=0, num_prompts=8)
    assert "--dataset-path /data/sg.json" in " ".join(sharegpt)
    last = len(sharegpt) - 1 - sharegpt[::-1].index("--num-prompts")  # the later one wins
    assert "--save-result" not in sharegpt and sharegpt[last + 1] == "8"


def _system(name, **figures):
    return {"name": name, "runs": {"random": figures}, "errors": {}}


def test_ratios_are_oriented_per_figure_and_kept_per_round():
    rounds = [[_system("kvrelay", output_throughput=200, median_ttft_ms=1000, p99_ttft_ms=3000),
               _system("vllm", output_throughput=100, median_ttft_ms=2000, p99_ttft_ms=3000)],
              [_system("kvrelay", output_throughput=150, median_ttft_ms=4000, p99_ttft_ms=0),
               _system("vllm", output_throughput=100, median_ttft_ms=2000, p99_ttft_ms=3000)]]
    ratios = vllm_bench.ratios(rounds, "random")["vllm"]
    assert ratios["out tok/s"] == [2.0, 1.5]  # more is better: mine over theirs
    assert ratios["TTFT p50 ms"] == [2.0, 0.5]  # less is better: theirs over mine
    assert ratios["TTFT p99 ms"] == [1.0]  # a missing (zero) figure gives no ratio
    assert vllm_bench.ratios(rounds, "prefix_repetition") == {}


def test_a_system_that_did_not_run_shows_its_error_in_the_table():
    failed = {"name": "vllm", "runs": {}, "errors": {"random": "failed to start: boom"}}
    table = vllm_bench.round_table("random", [_system("kvrelay", output_throughput=1.0,
                                                      completed=4, failed=0), failed])
    assert "failed to start: boom" in table and "| kvrelay | 4 / 0 | 1.00 |" in table
