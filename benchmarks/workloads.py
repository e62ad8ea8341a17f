"""The standard workloads (BENCHMARKS.md), generated from a fixed seed so every run sees the same
prompts. They live in services/bench (the installed `kvrelay bench` needs them); this module
keeps the scripts here importing them from where they always did."""
from __future__ import annotations

from kvrelay.bench.prompts import chat64, shared_prefix, user_message  # noqa: F401
from kvrelay.bench.workloads import (  # noqa: F401
    WORKLOADS, BenchRequest, build, chat_requests, load_jsonl, long_short, poisson_arrivals)
