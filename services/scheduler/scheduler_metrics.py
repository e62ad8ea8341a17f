"""The scheduler's Prometheus metrics (vLLM names under `kvrelay:`), updated after each step."""
from __future__ import annotations

import time

from kvrelay.common import metrics
from kvrelay.scheduler.adapters import adapter_use
from kvrelay.scheduler.cluster import ClusterScheduler
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.step_plan import StepPlan

RUNNING = metrics.gauge("num_requests_running", "Requests computing on a worker", ("worker",))
WAITING = metrics.gauge("num_requests_waiting", "Requests queued for a worker", ("worker",))
TRANSFERRING = metrics.gauge("num_requests_transferring", "Samples whose KV pages are in flight")
KV_USAGE = metrics.gauge("kv_cache_usage_perc", "Fraction of a worker's KV blocks in use",
                         ("worker",))
# What vLLM reports as cache_config_info's num_gpu_blocks x block_size: how many tokens of KV a
# worker holds in all (0 once it has left), for capacity beside the peers (benchmarks/compare.py).
KV_CAPACITY = metrics.gauge("kv_cache_capacity_tokens", "Tokens of KV a worker's cache holds",
                            ("worker",))
PREFIX_QUERIES = metrics.counter("prefix_cache_queries", "Prompt tokens looked up in a worker's "
                                 "prefix cache", ("worker",))
PREFIX_HITS = metrics.counter("prefix_cache_hits", "Prompt tokens found in a worker's prefix "
                              "cache", ("worker",))
PREEMPTIONS = metrics.counter("num_preemptions", "Preemptions on a worker", ("worker",))
WINDOW_FREED = metrics.counter("kv_window_freed_blocks", "KV blocks a worker freed while their "
                               "request ran: out of reach of every window layer that held them",
                               ("worker",))
PROMPT_TOKENS = metrics.counter("prompt_tokens", "Prompt tokens computed (prefill)")
GENERATION_TOKENS = metrics.counter("generation_tokens", "Tokens generated")
QUEUE_TIME = metrics.histogram("request_queue_time_seconds", "Arrival to first scheduled step")
STEP_TOKENS = metrics.histogram("iteration_tokens_total", "Tokens per engine step",
                                buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
# The transfer bytes / seconds / failures are the prefill workers' metrics (kv_connector).
TRANSFERS_DONE = metrics.counter("kv_transfers_completed", "KV transfers reported done",
                                 ("ok",))
TRANSFER_SHARED_TOKENS = metrics.counter(
    "kv_transfer_shared_prefix_tokens", "Prompt tokens of a shared prefix that a transfer did not "
    "push: the decode worker held their pages, or another transfer of the same step pushed them")
SET_ASIDE_BLOCKS = metrics.gauge(
    "kv_blocks_set_aside", "Decode blocks held until a lost prefill worker's sends expire",
    ("worker",))
STEPS = metrics.counter("worker_steps", "Steps run per worker", ("worker",))
AHEAD_STEPS = metrics.counter("worker_steps_planned_ahead", "Steps planned and sent while the "
                              "step before them ran (async scheduling)", ("worker",))
SPLIT_STEPS = metrics.counter("worker_split_steps", "Steps run on a share of the cores, beside "
                              "another worker's (--shared-compute-steps split)", ("worker",))
# Speculative decoding (vLLM's names): a draft is one sequence's proposal for one step.
SPEC_DRAFTS = metrics.counter("spec_decode_num_drafts", "Speculative drafts verified")
SPEC_DRAFT_TOKENS = metrics.counter("spec_decode_num_draft_tokens", "Draft tokens verified")
SPEC_ACCEPTED_TOKENS = metrics.counter("spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted")
SPEC_ACCEPTED_PER_POS = metrics.counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position",
                                        ("position",))
RECOVERIES = metrics.counter(
    "request_recoveries", "Samples prefilled again on a live worker after their worker died or "
    "their KV transfer failed (README: a dead worker costs no request)")
# vLLM's lora_requests_info: the labels name the adapters (comma-separated) that requests run
# and wait on; the value is when they were read. One series: the latest.
LORA_INFO = metrics.gauge("lora_requests_info", "LoRA adapters of running and waiting requests",
                          ("max_lora", "running_lora_adapters", "waiting_lora_adapters"))
# The engine cores keep running totals; the counters advance by the change since last time.
_last_totals: dict[tuple[str, str], int] = {}


def _advance(counter, worker: str, name: str, total: int) -> None:
    previous = _last_totals.get((worker, name), 0)
    if total > previous:
        counter.labels(worker).inc(total - previous)
    _last_totals[(worker, name)] = total


def _advance_total(counter, name: str, total: int) -> None:
    previous = _last_totals.get(("", name), 0)
    if total > previous:
        counter.inc(total - previous)
    _last_totals[("", name)] = total


def after_step(cluster: ClusterScheduler, worker: WorkerRecord, plan: StepPlan,
               num_sampled: int) -> None:
    name = worker.worker_id
    core = worker.core
    RUNNING.labels(name).set(len(core.running))
    WAITING.labels(name).set(len(core.waiting))
    KV_USAGE.labels(name).set(core.kv.usage)
    _advance(PREFIX_QUERIES, name, "queries", core.kv.stats.queries)
    _advance(PREFIX_HITS, name, "hits", core.kv.stats.hits)
    _advance(PREEMPTIONS, name, "preemptions", core.stats.num_preemptions)
    _advance(WINDOW_FREED, name, "window_freed", core.kv.num_window_freed)
    STEPS.labels(name).inc()
    if plan.ahead:
        AHEAD_STEPS.labels(name).inc()
    if plan.order.num_threads:
        SPLIT_STEPS.labels(name).inc()
    TRANSFERRING.set(cluster.transfers.num_open)
    _advance_total(TRANSFER_SHARED_TOKENS, "transfer_shared_prefix",
                   cluster.transfers.num_shared_prefix_tokens)
    now = time.monotonic()
    num_prompt = 0
    for item in plan.output.scheduled:
        request = item.request  # progress already advanced by this step
        end = request.num_computed_tokens
        num_prompt += max(0, min(request.num_prompt_tokens, end) - (end - item.num_new_tokens))
        sample = cluster.samples.get(request.sequence_id)
        if sample is not None and sample.parent.first_scheduled is None:
            sample.parent.first_scheduled = now
            QUEUE_TIME.observe(now - sample.parent.arrival)
    PROMPT_TOKENS.inc(num_prompt)
    GENERATION_TOKENS.inc(num_sampled)
    _advance_spec(cluster.registry.drafter)
    _advance_total(RECOVERIES, "recoveries", cluster.num_recoveries)
    STEP_TOKENS.observe(plan.output.num_batched_tokens)


def refresh_gauges(cluster: ClusterScheduler) -> None:
    """Every worker's gauges from its state now, not from its last step: blocks freed after a
    step (a transfer's pages landed, an abort, a worker's death) show, and an idle group reads
    zero. A worker that left reads zero too, so a dashboard never keeps its last value."""
    for worker in cluster.registry.workers.values():
        name, core = worker.worker_id, worker.core
        live = worker.alive
        RUNNING.labels(name).set(len(core.running) if live else 0)
        WAITING.labels(name).set(len(core.waiting) if live else 0)
        KV_USAGE.labels(name).set(core.kv.usage if live else 0.0)
        KV_CAPACITY.labels(name).set(worker.info.num_blocks * worker.info.block_size
                                     if live else 0)
    TRANSFERRING.set(cluster.transfers.num_open)
    _advance_total(RECOVERIES, "recoveries", cluster.num_recoveries)


def transfer_result(ok: bool) -> None:
    TRANSFERS_DONE.labels(str(ok).lower()).inc()


def blocks_set_aside(cluster: ClusterScheduler) -> None:
    held: dict[str, int] = {worker_id: 0 for worker_id in cluster.registry.workers}
    for entry in cluster.transfers.set_aside:
        held[entry.worker.worker_id] = held.get(entry.worker.worker_id, 0) + len(entry.blocks)
    for worker_id, num_blocks in held.items():
        SET_ASIDE_BLOCKS.labels(worker_id).set(num_blocks)


def _advance_spec(drafter) -> None:
    if drafter is None:
        return
    stats = drafter.stats
    _advance_total(SPEC_DRAFTS, "spec_drafts", stats.num_drafts)
    _advance_total(SPEC_DRAFT_TOKENS, "spec_draft_tokens", stats.num_draft_tokens)
    _advance_total(SPEC_ACCEPTED_TOKENS, "spec_accepted_tokens", stats.num_accepted_tokens)
    for position, total in enumerate(stats.accepted_per_pos):
        _advance(SPEC_ACCEPTED_PER_POS, str(position), "spec_accepted_per_pos", total)


def lora_requests(cluster: ClusterScheduler, names: dict[int, str]) -> None:
    workers = [worker for worker in cluster.registry.workers.values() if worker.alive]
    use = adapter_use(workers)
    running = ",".join(sorted(names.get(i, str(i)) for i, (num, _) in use.items() if num))
    waiting = ",".join(sorted(names.get(i, str(i)) for i, (_, num) in use.items() if num))
    max_lora = min((worker.info.max_loras for worker in workers), default=0)
    LORA_INFO.clear()
    LORA_INFO.labels(str(max_lora), running, waiting).set(time.time())
