"""From request records to the numbers a serving benchmark reports.

Percentiles interpolate linearly between order statistics (numpy's default), so p50 of an even
count is the mean of the two middle values. Goodput counts the requests that met both SLOs:
TTFT <= slo_ttft and TPOT <= slo_tpot (a one-token output has no TPOT and passes on TTFT alone);
its fraction is over every request sent, failed ones included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvrelay.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft_s > self.ttft_s:
            return False
        return record.tpot_s is None or record.tpot_s <= self.tpot_s


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict:
    """mean and p50/p90/p99 (None when nothing was measured)."""
    summary = {"count": len(values),
               "mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        summary[f"p{q}"] = percentile(values, q)
    return summary


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_known = all(r.prompt_tokens is not None for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok) if prompt_known else None
    good = sum(1 for r in records if slo.met_by(r))
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    return {
        "requests_sent": len(records),
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "tokens_from_usage": all(r.usage_reported for r in ok),
        "requests_per_s": per_s(len(ok)),
        "output_tokens_per_s": per_s(output_tokens),
        "total_tokens_per_s": (per_s(prompt_tokens + output_tokens)
                               if prompt_tokens is not None else None),
        "ttft_s": distribution([r.ttft_s for r in ok]),
        "itl_s": distribution([gap for r in ok for gap in r.itls_s]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": distribution([r.done_s for r in ok]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput_requests": good,
        "goodput_fraction": good / len(records) if records else None,
        "goodput_requests_per_s": per_s(good),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def max_rate_meeting(sweep: list[tuple[float, dict]], fraction: float = 0.9) -> float | None:
    """The highest swept rate whose goodput fraction reached `fraction` (None: none did)."""
    passing = [rate for rate, summary in sweep
               if (summary["goodput_fraction"] or 0) >= fraction]
    return max(passing, default=None)
