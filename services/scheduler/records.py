"""What the scheduler service tracks beyond the engine core: workers, requests and the samples
of each request as they move between workers."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.api.kvrelay.v1 import common_pb2, scheduler_pb2, worker_pb2
from services.engine.block_pool import KVBlock
from services.engine.request import Request
from services.engine.scheduler import Scheduler

PREFILL, DECODE, BOTH = (scheduler_pb2.WORKER_ROLE_PREFILL, scheduler_pb2.WORKER_ROLE_DECODE,
                         scheduler_pb2.WORKER_ROLE_BOTH)


class Phase(enum.Enum):
    PREFILL = "prefill"  # queued or computing the prompt on the prefill (or colocated) worker
    TRANSFER = "transfer"  # first token out; KV pages on their way to the decode worker
    DECODE = "decode"  # generating on the decode worker
    COLOCATED = "colocated"  # everything on one `--role both` worker
    DONE = "done"


@dataclass(slots=True)
class WorkerRecord:
    info: scheduler_pb2.RegisterWorkerRequest
    core: Scheduler  # this worker's queues and block pool
    lease_deadline: float
    draining: bool = False
    alive: bool = True
    known_blocks: dict[str, int] = field(default_factory=dict)  # seq id -> blocks it was sent
    forget: list[str] = field(default_factory=list)  # seq ids to drop at the next step
    pending_sends: list[worker_pb2.KvSendOrder] = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> int:
        return self.info.role

    @property
    def has_work(self) -> bool:
        return bool(self.core.running) or bool(self.core.waiting) or bool(self.pending_sends)

    def load(self) -> tuple[int, float]:
        return (len(self.core.running) + len(self.core.waiting), self.core.kv.usage)


@dataclass(slots=True)
class SampleRecord:
    """One of a request's n samples: the engine request on the side it currently lives on."""
    seq_id: str
    index: int
    parent: "RequestRecord"
    request: Request  # the prefill/colocated side's engine request
    worker: WorkerRecord
    phase: Phase
    decode_request: Request | None = None  # the decode side's copy, from the reservation on
    decode_worker: WorkerRecord | None = None
    transfer_id: str | None = None
    send_in_flight: bool = False  # an order reached the prefill worker; wait for its result
    pages_delivered: bool = False  # a layer-by-layer send can finish before its step's result
    send_step: int = 0  # the prefill step whose message carried the send order
    send_deadline: float = 0.0  # monotonic: no page of the order is written after it
    # transfers of the same step that push leading blocks this sample shares (handoff.py)
    relies_on: frozenset[str] = frozenset()


@dataclass(slots=True)
class SetAside:
    """Decode blocks a lost prefill worker's send may still write into: held, owned by no
    request, until the send's deadline has passed."""
    worker: WorkerRecord
    blocks: list[KVBlock]
    until: float  # monotonic


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    gateway_id: str
    num_prompt_tokens: int
    params: common_pb2.SamplingParams  # as submitted (with max_tokens filled in), for workers
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    samples: list[SampleRecord] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(sample.phase is Phase.DONE for sample in self.samples)
