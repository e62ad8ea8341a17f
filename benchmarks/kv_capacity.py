"""How many tokens of KV a served system holds, read from the server itself after its workloads
(beside its memory, benchmarks/memory.py): kvrelay's scheduler gauge
`kvrelay:kv_cache_capacity_tokens` (one series per worker), vLLM's `vllm:cache_config_info`
(num_gpu_blocks x block_size, its CPU blocks on the CPU build), llama-server's /props (slots x
each slot's context). None where the server says nothing it can be read from.

While a workload runs, `usage` reads how much of each worker's (vLLM: each engine's) KV is in
use, in tokens' worth of its capacity (benchmarks/long_context.py samples it per request)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

_KVRELAY = re.compile(r"^kvrelay:kv_cache_capacity_tokens\{[^}]*\} (\S+)$", re.MULTILINE)
_VLLM_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\} \S+$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def from_metrics(text: str) -> int | None:
    """Tokens of KV a Prometheus text reports in all, or None where it reports none."""
    kvrelay = [float(value) for value in _KVRELAY.findall(text)]
    if kvrelay:
        return int(sum(kvrelay))
    total = None
    for labels in _VLLM_INFO.findall(text):
        fields = dict(_LABEL.findall(labels))
        try:
            tokens = int(fields["num_gpu_blocks"]) * int(fields["block_size"])
        except (KeyError, ValueError):  # an engine that has not sized its cache says "None"
            continue
        total = (total or 0) + tokens
    return total


def from_llama_props(props: dict) -> int | None:
    """llama-server's /props: every slot holds its own context of n_ctx tokens."""
    try:
        return int(props["total_slots"]) * int(props["default_generation_settings"]["n_ctx"])
    except (KeyError, TypeError, ValueError):
        return None


def read(base_url: str, metrics_urls: list[str], timeout_s: float = 10.0) -> int | None:
    """The server's KV capacity in tokens: its metrics first, then llama-server's /props."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for url in metrics_urls:
            try:
                tokens = from_metrics(client.get(url).text)
            except httpx.HTTPError:
                continue
            if tokens is not None:
                return tokens
        try:
            response = client.get(f"{base_url}/props")
            return from_llama_props(response.json()) if response.is_success else None
        except (httpx.HTTPError, ValueError):
            return None


_SAMPLE = re.compile(r"^(kvrelay|vllm):(\w+)\{([^}]*)\} (\S+)$", re.MULTILINE)
# the label that names a cache: a kvrelay worker, a vLLM engine core
_CACHE_LABEL = {"kvrelay": "worker", "vllm": "engine"}


@dataclass(frozen=True)
class CacheUsage:
    """One KV cache at one moment: its capacity, the fraction in use, requests running on it,
    and its blocks where the server says them (vLLM's cache_config_info: with a hybrid cache
    its blocks are shared by layer groups, so a block is not a token of every layer; kvrelay's
    are capacity / the worker's --block-size, which its metrics do not carry)."""
    name: str
    capacity_tokens: int
    usage: float
    running: int
    block_size: int | None = None
    num_blocks: int | None = None

    @property
    def held_tokens(self) -> float:
        """What is in use, in tokens of KV at full attention (capacity x usage)."""
        return self.capacity_tokens * self.usage


def usage(text: str) -> list[CacheUsage]:
    """Every KV cache a Prometheus text reports both a capacity and a usage for."""
    fields: dict[tuple[str, str], dict[str, float]] = {}
    for system, metric, labels, value in _SAMPLE.findall(text):
        label = dict(_LABEL.findall(labels))
        name = label.get(_CACHE_LABEL[system])
        if name is None:
            continue
        entry = fields.setdefault((system, name), {})
        if metric == "cache_config_info":
            entry["block_size"] = _int_or_none(label.get("block_size"))
            entry["num_blocks"] = _int_or_none(label.get("num_gpu_blocks"))
            entry["kv_cache_capacity_tokens"] = (entry["block_size"] or 0) * (
                entry["num_blocks"] or 0)  # as from_metrics reads it
        elif metric in ("kv_cache_capacity_tokens", "kv_cache_usage_perc",
                        "num_requests_running"):
            entry[metric] = float(value)
    return [CacheUsage(name, int(entry["kv_cache_capacity_tokens"]),
                       entry["kv_cache_usage_perc"], int(entry.get("num_requests_running", 0)),
                       entry.get("block_size"), entry.get("num_blocks"))
            for (_, name), entry in sorted(fields.items())
            if entry.get("kv_cache_capacity_tokens") and "kv_cache_usage_perc" in entry]


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):  # absent, or "None" before the cache is sized
        return None
