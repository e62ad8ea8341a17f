"""The markdown table of a benchmark's runs, one row per run (and per tagged subset)."""
from __future__ import annotations

HEADER = ("| run | ok / sent | req/s | output tok/s | total tok/s | TTFT s p50 / p90 / p99 | "
          "ITL ms p50 / p90 / p99 | TPOT ms p50 / p90 / p99 | e2e s p50 / p90 / p99 | "
          "goodput |")
RULE = "|---|---|---|---|---|---|---|---|---|---|"


def _num(value, digits: int = 1, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _triple(dist: dict, digits: int, scale: float = 1.0) -> str:
    return " / ".join(_num(dist[f"p{q}"], digits, scale) for q in (50, 90, 99))


def summary_row(label: str, s: dict) -> str:
    goodput = ("-" if s["goodput_fraction"] is None else
               f"{s['goodput_fraction']:.0%} ({_num(s['goodput_requests_per_s'], 2)} req/s)")
    total = _num(s["total_tokens_per_s"])
    cells = [label, f"{s['requests_ok']} / {s['requests_sent']}", _num(s["requests_per_s"], 2),
             _num(s["output_tokens_per_s"]), total, _triple(s["ttft_s"], 2),
             _triple(s["itl_s"], 1, 1e3), _triple(s["tpot_s"], 1, 1e3), _triple(s["e2e_s"], 2),
             goodput]
    return "| " + " | ".join(cells) + " |"


def tagged_subsets(run: dict) -> list[tuple[str, dict]]:
    """The per-tag summaries worth a row: only where the run mixes tags (long+short)."""
    by_tag = run.get("by_tag", {})
    return sorted(by_tag.items()) if len(by_tag) > 1 else []


def table(runs: list[dict]) -> str:
    """runs: dicts with "label", "summary" and optionally "by_tag" {tag: summary}."""
    lines = [HEADER, RULE]
    for run in runs:
        lines.append(summary_row(run["label"], run["summary"]))
        for tag, summary in tagged_subsets(run):
            lines.append(summary_row(f"{run['label']}: {tag} requests", summary))
    return "\n".join(lines)


def notes(result: dict) -> list[str]:
    """Lines under the table: SLOs, how tokens were counted, sweep and long+short findings."""
    lines = []
    slo = result["config"]["slo"]
    lines.append(f"Goodput: requests with TTFT <= {slo['ttft_s']} s and TPOT <= "
                 f"{slo['tpot_s'] * 1e3:.0f} ms, as a share of requests sent.")
    if any(not run["summary"]["tokens_from_usage"] for run in result["runs"]):
        lines.append("Some server sent no usage: output tokens were counted as content chunks.")
    sweep = result.get("sweep")
    if sweep:
        best = sweep["max_rate_goodput_90"]
        lines.append("Highest swept rate with goodput >= 90%: "
                     + ("none" if best is None else f"{best:g} req/s") + ".")
    ratio = result.get("long_short_itl_p99_ratio")
    if ratio is not None:
        lines.append(f"long+short: ITL p99 of the short requests with the long prompts / "
                     f"without them = {ratio:.2f}x.")
    for run in result["runs"]:
        spec = run.get("spec_decode")
        if spec and spec["drafts"]:
            lines.append(f"{run['label']}: speculative decoding accepted "
                         f"{spec['acceptance_rate']:.0%} of {spec['draft_tokens']:.0f} draft "
                         f"tokens; mean acceptance length {spec['mean_acceptance_length']:.2f} "
                         f"tokens per verified step.")
    for run in result["runs"]:
        for error in run["summary"]["errors"]:
            lines.append(f"{run['label']}: error: {error}")
    return lines


def markdown(result: dict) -> str:
    return "\n".join([table(result["runs"]), ""] + notes(result)) + "\n"
