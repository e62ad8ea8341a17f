"""How long a prefill worker waits for more prompts before a step, while it shares its cores
with a decode worker's running sequences.

On one machine every prefill step stops the decodes for its whole length, and a step's cost is
far from proportional to its prompts: it reads every weight once whatever its size (on the
standard machine one 200-token prompt took 120 ms where four took 323 and eight 659, so a
prompt alone costs ~1.5x its share of a batch). Under a steady stream of requests, prompts
stepped one by one spend the cores least well exactly when the decodes need them most: the
load's TPOT, not its TTFT, is what gives out first (BENCHMARKS.md, poisson). So a prefill worker
whose prompts are few waits, up to `shared_prefill_linger_ms` after the oldest of them arrived,
for enough prompt tokens to make a step worth its interruption. A burst is not delayed (its
tokens pass the threshold at once), nor is anything part-way through its prefill, nor a worker
with KV pages still to send, nor one that shares no cores with running decodes.
"""
from __future__ import annotations

from services.scheduler.cluster import ClusterScheduler
from services.scheduler.registry import WorkerRecord


def linger_s(cluster: ClusterScheduler, worker: WorkerRecord, now: float) -> float:
    """Seconds the worker should still wait before planning a step (0: step now). `now` is
    time.monotonic(), the clock of the requests' arrival times."""
    config = cluster.config
    if config.shared_prefill_linger_ms <= 0:
        return 0.0
    core = worker.core
    if core.running or not core.waiting or cluster.transfers.has_outgoing(worker):
        return 0.0
    if not cluster.registry.shares_compute_with_decodes(worker):
        return 0.0
    waiting = list(core.waiting)
    queued_tokens = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
    if queued_tokens >= config.shared_prefill_linger_tokens:
        return 0.0
    oldest = min(r.arrival_time for r in waiting)
    return max(0.0, oldest + config.shared_prefill_linger_ms / 1000 - now)
