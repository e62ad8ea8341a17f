"""Speculative decoding's acceptance, read from the server's Prometheus counters before and
after a run (kvrelay's scheduler and vLLM use the same names, under `kvrelay:` and `vllm:`)."""
from __future__ import annotations

import re

import httpx

_COUNTERS = {"drafts": "spec_decode_num_drafts", "draft_tokens": "spec_decode_num_draft_tokens",
             "accepted_tokens": "spec_decode_num_accepted_tokens"}
_LINE = re.compile(r"^(?:kvrelay|vllm):(spec_decode_num_\w+?)(?:_total)?(\{[^}]*\})? (\S+)$",
                   re.MULTILINE)


async def scrape(urls: list[str]) -> dict[str, float] | None:
    """The counters summed over the endpoints; None when no endpoint has them (speculation
    off, or a server without it)."""
    totals: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for url in urls:
            text = (await client.get(url)).text
            for name, _, value in _LINE.findall(text):
                totals[name] = totals.get(name, 0.0) + float(value)
    found = {key: totals[name] for key, name in _COUNTERS.items() if name in totals}
    return found if len(found) == len(_COUNTERS) else None


def acceptance(before: dict | None, after: dict | None) -> dict | None:
    """The run's share: acceptance rate (accepted / drafted tokens) and mean acceptance
    length (tokens a verified step emitted: its accepted drafts plus the one sampled after)."""
    if before is None or after is None:
        return None
    delta = {key: after[key] - before.get(key, 0.0) for key in _COUNTERS}
    if delta["drafts"] <= 0:
        return {**delta, "acceptance_rate": None, "mean_acceptance_length": None}
    return {**delta,
            "acceptance_rate": delta["accepted_tokens"] / max(delta["draft_tokens"], 1.0),
            "mean_acceptance_length": 1.0 + delta["accepted_tokens"] / delta["drafts"]}
