"""Percentiles, per-request latencies and goodput, on records with known timings."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvrelay.bench.metrics import Slo, distribution, max_rate_meeting, percentile, summarize
from kvrelay.bench.records import RequestRecord


def record(index, token_times, done=None, tokens=None, prompt=10, error=None, tag=""):
    return RequestRecord(index, tag, sent_s=0.0, token_times_s=list(token_times),
                         done_s=token_times[-1] if done is None and token_times else done,
                         output_tokens=len(token_times) if tokens is None else tokens,
                         prompt_tokens=prompt, usage_reported=True, error=error)


def test_percentile_matches_numpy_linear_interpolation():
    rng = random.Random(0)
    for size in (1, 2, 3, 10, 101):
        values = [rng.random() for _ in range(size)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_small_cases():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert distribution([]) == {"count": 0, "mean": None, "p50": None, "p90": None,
                                "p99": None}


def test_one_record_ttft_itl_tpot_e2e():
    r = record(0, [0.5, 0.6, 0.8, 0.9], done=1.0)
    assert r.ttft_s == 0.5
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.1])
    assert r.tpot_s == pytest.approx((1.0 - 0.5) / 3)
    assert record(1, [0.5]).tpot_s is None  # one token: no time *per* further token


def test_summary_rates_and_latencies():
    records = [record(0, [0.2, 0.3, 0.4], done=0.4), record(1, [1.0, 1.5], done=2.0)]
    s = summarize(records, duration_s=2.0, slo=Slo())
    assert s["requests_ok"] == 2 and s["requests_failed"] == 0
    assert s["output_tokens"] == 5 and s["prompt_tokens"] == 20
    assert s["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["total_tokens_per_s"] == pytest.approx(12.5)
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.6)
    assert s["itl_s"]["count"] == 3 and s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["e2e_s"]["p99"] == pytest.approx(0.4 + 1.6 * 0.99)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 1.0) / 2)


def test_goodput_needs_both_slos_and_counts_failures_in_the_share():
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0, [0.5, 0.55, 0.6]),        # meets both
        record(1, [1.5, 1.55]),             # TTFT too slow
        record(2, [0.2, 0.5, 0.8]),         # TPOT 0.3 s too slow
        record(3, [0.9]),                   # one token: TTFT alone decides
        record(4, [0.1], error="HTTP 500"), # failed
    ]
    s = summarize(records, duration_s=4.0, slo=slo)
    assert s["goodput_requests"] == 2
    assert s["goodput_fraction"] == pytest.approx(2 / 5)
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)
    assert s["requests_failed"] == 1 and s["errors"] == ["HTTP 500"]


def test_unknown_prompt_tokens_leave_total_throughput_unknown():
    s = summarize([record(0, [0.1, 0.2], prompt=None)], duration_s=1.0, slo=Slo())
    assert s["prompt_tokens"] is None and s["total_tokens_per_s"] is None
    assert s["output_tokens_per_s"] == pytest.approx(2.0)


def test_max_rate_meeting_goodput():
    sweep = [(1.0, {"goodput_fraction": 1.0}), (2.0, {"goodput_fraction": 0.95}),
             (4.0, {"goodput_fraction": 0.5}), (8.0, {"goodput_fraction": None})]
    assert max_rate_meeting(sweep) == 2.0
    assert max_rate_meeting(sweep, 0.99) == 1.0
    assert max_rate_meeting(sweep[2:]) is None
