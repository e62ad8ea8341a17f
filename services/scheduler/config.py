"""The scheduler service's configuration, handed whole to its core at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.config import GRAMMAR_BACKENDS, EngineConfig

SHARED_COMPUTE_MODES = ("serialize", "split", "overlap")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Per-worker scheduling knobs (budgets, chunking, prefix caching, policy); each worker's
    # block count, block size and context length come from its registration.
    engine: EngineConfig = field(default_factory=EngineConfig)
    lease_s: float = 3.0  # a worker silent this long is declared dead
    # A prefill-only worker's step budget (None: the engine's). Bigger steps are not more
    # efficient on CPU (a burst of 64 prompts: 1,960 tok/s in 2,048-token steps, 1,840 in
    # 8,192-token ones), and each step's prompts get their first token only when it ends.
    prefill_max_num_batched_tokens: int | None = None
    # While a decode worker of its compute domain has sequences running, a prefill step this
    # big at most keeps their inter-token latency in check (None: no cap).
    shared_prefill_max_num_batched_tokens: int | None = None
    # While a step of plain decodes runs, plan the next one and send it, so the worker goes on
    # without waiting for the round trip (worker_link.py).
    async_scheduling: bool = True
    # How workers of one compute domain share it (core_share.py).
    shared_compute_steps: str = "split"
    transfer_timeout_s: float = 30.0  # an order's pages are written within this, or never
    kv_transport: str = "shm"  # same-host pairs copy pages through shared memory; "grpc": never
    # Structured output: the model whose tokenizer the grammars are compiled for (the workers'
    # model; None: the default one), and the backend that compiles them.
    model: str | None = None
    structured_outputs_backend: str = "llguidance"
    # Overload: a request that would take the samples waiting for a first step past this many,
    # or their prompt tokens past this many, is refused with RESOURCE_EXHAUSTED (the gateway's
    # 503 with Retry-After) instead of queueing without bound. 0: no limit.
    max_queued_requests: int = 1024
    max_queued_prompt_tokens: int = 1 << 20
    # A sample whose worker died (or whose KV transfer failed) is re-prefilled elsewhere, its
    # tokens so far as the prompt, at most this many times (a poison request must not take
    # down worker after worker); 0: it ends with the error at once.
    max_request_retries: int = 2
    # Such a sample waits at most this long for a live worker of the role it needs (one being
    # restarted) before it ends with the error.
    worker_wait_s: float = 60.0
    # LoRA (engine.enable_lora): adapters to load at start, {name: PEFT directory}, each loaded
    # on every worker as it registers; at most max_cpu_loras adapters loaded at once.
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_cpu_loras: int = 64

    def __post_init__(self) -> None:
        if self.shared_compute_steps not in SHARED_COMPUTE_MODES:
            raise ValueError(f"shared_compute_steps must be one of {SHARED_COMPUTE_MODES}")
        if self.kv_transport not in ("grpc", "shm"):
            raise ValueError(f"kv_transport must be grpc or shm, got {self.kv_transport!r}")
        if self.structured_outputs_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {GRAMMAR_BACKENDS}")
        if self.max_queued_requests < 0 or self.max_queued_prompt_tokens < 0:
            raise ValueError("max_queued_requests and max_queued_prompt_tokens must be >= 0")
        if self.max_request_retries < 0 or self.worker_wait_s < 0:
            raise ValueError("max_request_retries and worker_wait_s must be >= 0")
        if self.lora_modules and not self.engine.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be >= 1")
        if self.lease_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("lease_s and transfer_timeout_s must be > 0")
