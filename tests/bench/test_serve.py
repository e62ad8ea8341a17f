"""`kvrelay bench serve` end to end against a real local HTTP server with known timings."""
from __future__ import annotations

import json

import pytest

from kvrelay.cli import main
from tests.bench.fake_server import FakeBehaviour, FakeServer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLACK_S = 0.12  # a busy 2-core machine delays a chunk's reading by a few tens of ms at most


def bench(server, out, *flags, exit_code: int = 0) -> dict:
    code = main(["bench", "serve", "--base-url", server.url, "--out", str(out), *flags])
    assert code == exit_code
    return json.loads((out / "result.json").read_text())


def test_chat64_metrics_follow_the_chunk_timings(tmp_path, capsys):
    with FakeServer(FakeBehaviour(ttft=0.3, itl=0.1)) as server:
        result = bench(server, tmp_path, "--max-requests", "4", "--max-tokens", "4",
                       "--slo-tpot", "0.15")
    s = result["runs"][0]["summary"]
    assert s["requests_sent"] == 4 and s["requests_ok"] == 4
    assert s["output_tokens"] == 16 and s["prompt_tokens"] == 28 and s["tokens_from_usage"]
    assert 0.3 <= s["ttft_s"]["p50"] <= 0.3 + SLACK_S
    # the server sleeps 0.1 s between chunks; a busy machine only lengthens a gap (and the
    # next one may then shrink by as much), so the bound is wider above than below
    assert s["itl_s"]["count"] == 12 and 0.09 <= s["itl_s"]["mean"] <= 0.1 + SLACK_S / 2
    assert 0.09 <= s["tpot_s"]["p50"] <= 0.1 + SLACK_S / 2
    assert 0.6 <= s["e2e_s"]["p50"] <= 0.6 + SLACK_S
    assert s["output_tokens_per_s"] == pytest.approx(16 / s["duration_s"])
    assert s["goodput_fraction"] == 1.0  # 0.3 s TTFT, 100 ms TPOT: within 2 s / 150 ms
    assert result["config"]["model"] == "fake-model"  # found through /v1/models
    assert len(server.behaviour.bodies) == 4
    assert all(body["ignore_eos"] and body["temperature"] == 0.0 and body["max_tokens"] == 4
               for body in server.behaviour.bodies)
    out = capsys.readouterr()
    assert "| chat-64 | 4 / 4 |" in out.out
    assert "[chat-64] 4/4 done" in out.err  # the progress line
    assert (tmp_path / "results.md").read_text().startswith("| run |")
    assert (tmp_path / "latency_cdf.png").read_bytes().startswith(PNG_SIGNATURE)


def test_percentiles_and_goodput_over_requests_of_different_speeds(tmp_path):
    # A JSONL workload passes extra fields through: each request asks for its own TTFT.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 2,
                                           "fake_ttft": 0.1 * i, "fake_itl": 0.05}) + "\n"
                               for i in range(1, 5)))
    with FakeServer() as server:
        result = bench(server, tmp_path / "out", "--workload", "jsonl", "--jsonl",
                       str(prompts), "--slo-ttft", "0.25", "--model", "m")
    s = result["runs"][0]["summary"]
    assert 0.25 <= s["ttft_s"]["p50"] <= 0.25 + SLACK_S  # between 0.2 and 0.3
    # p99 of four interpolates 97% of the way from the third to the fourth (0.397 s if exact)
    assert 0.39 <= s["ttft_s"]["p99"] <= 0.4 + SLACK_S
    assert s["goodput_requests"] == 2 and s["goodput_fraction"] == 0.5  # TTFT 0.1 and 0.2
    assert all(body["model"] == "m" for body in server.behaviour.bodies)


def test_without_usage_tokens_are_counted_from_chunks(tmp_path):
    with FakeServer(FakeBehaviour(ttft=0.01, itl=0.01, send_usage=False)) as server:
        result = bench(server, tmp_path, "--max-requests", "2", "--max-tokens", "5")
    s = result["runs"][0]["summary"]
    assert s["output_tokens"] == 10 and not s["tokens_from_usage"]
    assert s["prompt_tokens"] is None and s["total_tokens_per_s"] is None
    assert "counted as content chunks" in (tmp_path / "results.md").read_text()


def test_transformers_backend_passes_a_server_that_refuses_unknown_fields(tmp_path):
    behaviour = FakeBehaviour(ttft=0.01, itl=0.01, reject_fields={"ignore_eos"})
    with FakeServer(behaviour) as server:
        refused = main(["bench", "serve", "--base-url", server.url, "--out",
                        str(tmp_path / "a"), "--max-requests", "1", "--max-tokens", "2"])
        result = bench(server, tmp_path / "b", "--max-requests", "1", "--max-tokens", "2",
                       "--backend", "transformers")
    assert refused == 1  # every request failed with the server's 422
    assert result["runs"][0]["summary"]["requests_ok"] == 1
    assert "generation_config" in behaviour.bodies[-1]


def test_time_limit_cancels_what_is_still_running(tmp_path):
    with FakeServer(FakeBehaviour(ttft=0.05, itl=0.5)) as server:
        result = bench(server, tmp_path, "--max-requests", "2", "--max-tokens", "50",
                       "--time-limit", "0.5", exit_code=1)  # 1: nothing completed
    s = result["runs"][0]["summary"]
    assert s["requests_sent"] == 2 and s["requests_ok"] == 0
    assert s["duration_s"] == 0.5
    assert s["errors"] == ["cancelled at the time limit"]


def test_poisson_sweep_writes_throughput_and_goodput_plots(tmp_path):
    with FakeServer(FakeBehaviour(ttft=0.01, itl=0.005)) as server:
        result = bench(server, tmp_path, "--workload", "poisson", "--rates", "20,40",
                       "--max-requests", "6", "--max-tokens", "3")
    assert [run["rate"] for run in result["runs"]] == [20.0, 40.0]
    assert [run["label"] for run in result["runs"]] == ["poisson @ 20 req/s",
                                                        "poisson @ 40 req/s"]
    sent = [r["sent_s"] for r in result["runs"][0]["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0.05  # spread over time, not all at once
    assert result["sweep"]["max_rate_goodput_90"] == 40.0
    assert (tmp_path / "rate_sweep.png").read_bytes().startswith(PNG_SIGNATURE)


def test_each_rate_of_a_poisson_sweep_sends_its_own_prompts(tmp_path):
    # the same prompts again would meet the server's prefix cache at every later rate
    with FakeServer(FakeBehaviour(ttft=0.01, itl=0.005)) as server:
        bench(server, tmp_path, "--workload", "poisson", "--rates", "40,40,40",
              "--max-requests", "4", "--max-tokens", "2", "--warmup", "4")
        bodies = [json.dumps(body["messages"]) for body in server.behaviour.bodies]
    warmup, rates = bodies[:4], [bodies[4 + 4 * i:8 + 4 * i] for i in range(3)]
    seen = [set(warmup), *map(set, rates)]
    assert all(not a & b for i, a in enumerate(seen) for b in seen[i + 1:])


def test_a_poisson_sweep_warms_up_first(tmp_path):
    with FakeServer(FakeBehaviour(ttft=0.01, itl=0.005)) as server:
        result = bench(server, tmp_path, "--workload", "poisson", "--rates", "40",
                       "--max-requests", "3", "--max-tokens", "2", "--warmup", "2")
        assert len(server.behaviour.bodies) == 2 + 3  # the warm-up requests, then the run
    assert result["runs"][0]["summary"]["requests_ok"] == 3


def test_long_short_reports_short_requests_with_and_without_the_long_ones(tmp_path):
    with FakeServer(FakeBehaviour(ttft=0.01, itl=0.01)) as server:
        result = bench(server, tmp_path, "--workload", "long+short", "--rate", "200",
                       "--max-tokens", "3")
    without, with_long = result["runs"]
    assert without["phase"] == "without long" and with_long["phase"] == "with long"
    assert without["summary"]["requests_ok"] == 32 and with_long["summary"]["requests_ok"] == 36
    assert set(with_long["by_tag"]) == {"long", "short"}
    assert with_long["by_tag"]["short"]["requests_ok"] == 32
    long_bodies = [b for b in server.behaviour.bodies
                   if len(b["messages"][0]["content"]) > 10_000]
    assert len(long_bodies) == 4
    p99 = [run["by_tag"]["short"]["itl_s"]["p99"] for run in (with_long, without)]
    ratio = p99[0] / p99[1]
    assert result["long_short_itl_p99_ratio"] == pytest.approx(ratio)
    assert "short requests" in (tmp_path / "results.md").read_text()


def test_bad_arguments_exit_2(tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--workload",
                 "poisson", "--out", str(tmp_path)])
    assert code == 2 and "--rate" in capsys.readouterr().err


def test_max_concurrency_holds_requests_back(tmp_path):
    with FakeServer(FakeBehaviour(ttft=0.05, itl=0.01)) as server:
        result = bench(server, tmp_path, "--max-requests", "3", "--max-tokens", "2",
                       "--max-concurrency", "1")
    requests = result["runs"][0]["requests"]
    for earlier, later in zip(requests, requests[1:]):
        assert later["sent_s"] >= earlier["sent_s"] + earlier["done_s"]
