"""PNG plots with matplotlib's Agg backend (no display needed): latency CDFs of each run, and
throughput and goodput against request rate for a rate sweep."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless machines and CI have no display
import matplotlib.pyplot as plt  # noqa: E402

from kvrelay.bench.records import RequestRecord  # noqa: E402

# (title, unit scale, how to get the values of one run)
LATENCIES = [
    ("TTFT (s)", 1.0, lambda recs: [r.ttft_s for r in recs]),
    ("ITL (ms)", 1e3, lambda recs: [gap for r in recs for gap in r.itls_s]),
    ("TPOT (ms)", 1e3, lambda recs: [r.tpot_s for r in recs if r.tpot_s is not None]),
    ("e2e latency (s)", 1.0, lambda recs: [r.done_s for r in recs]),
]


def latency_cdfs(runs: list[tuple[str, list[RequestRecord]]], path: Path) -> Path:
    """One panel per latency, one empirical CDF line per run."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for axis, (title, scale, values_of) in zip(axes.flat, LATENCIES):
        for label, records in runs:
            values = sorted(v * scale for v in values_of([r for r in records if r.ok]))
            if values:
                # Start from 0 at the smallest value so the curve rises from the axis.
                fractions = [i / len(values) for i in range(len(values) + 1)]
                axis.step([values[0]] + values, fractions, where="post", label=label)
        axis.set_title(title)
        axis.set_ylabel("fraction of samples")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0]:  # a run with no completed request has none
        axes.flat[0].legend(fontsize=8, loc="lower right")
    return _save(figure, path)


def rate_sweep(points: list[tuple[float, dict]], path: Path) -> Path:
    """Output tok/s, and goodput (req/s and share of requests), against the request rate."""
    rates = [rate for rate, _ in points]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(rates, [s["output_tokens_per_s"] or 0 for _, s in points], "o-")
    left.set_title("throughput")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("output tokens/s")
    right.plot(rates, [s["requests_per_s"] or 0 for _, s in points], "o-", label="completed")
    right.plot(rates, [s["goodput_requests_per_s"] or 0 for _, s in points], "s-",
               label="within SLOs (goodput)")
    right.set_title("goodput")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("requests/s")
    share = right.twinx()
    share.plot(rates, [(s["goodput_fraction"] or 0) * 100 for _, s in points], "x--",
               color="gray", label="% within SLOs (right axis)")
    share.set_ylabel("% of requests within SLOs", color="gray")
    share.set_ylim(0, 110)
    handles, labels = right.get_legend_handles_labels()
    more_handles, more_labels = share.get_legend_handles_labels()
    share.legend(handles + more_handles, labels + more_labels, fontsize=8, loc="lower right")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
