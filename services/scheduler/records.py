"""What the scheduler tracks of each request: its samples and where each one is in its life.

A sample lives on one worker at a time (`worker`, `request`). In the PD topology it is queued
and prefilled on a prefill worker, hands its pages over through a `Transfer` (transfers.py)
and, once they have landed, moves to the decode worker; on a `--role both` worker it runs start
to end in one place.

    PREFILL --first token--> TRANSFER --pages landed--> DECODE --> DONE
    COLOCATED --> DONE;  any phase --ended (finished, aborted, failed)--> DONE
    PREFILL, TRANSFER, DECODE --its worker died, or its transfer failed--> PREFILL (recovery:
    prefilled again over its prompt and the tokens it generated so far, which stay outputs);
    COLOCATED --the same--> COLOCATED
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvrelay.engine.request import Request
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.transfers import Transfer, TransferState


class Phase(enum.Enum):
    PREFILL = "prefill"  # queued or computing the prompt on the prefill worker
    TRANSFER = "transfer"  # first token out; KV pages on their way to the decode worker
    DECODE = "decode"  # generating on the decode worker
    COLOCATED = "colocated"  # everything on one `--role both` worker
    DONE = "done"


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.PREFILL: frozenset({Phase.TRANSFER, Phase.PREFILL, Phase.DONE}),
    Phase.TRANSFER: frozenset({Phase.DECODE, Phase.PREFILL, Phase.DONE}),
    Phase.DECODE: frozenset({Phase.PREFILL, Phase.DONE}),
    Phase.COLOCATED: frozenset({Phase.COLOCATED, Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalPhase(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class SampleRecord:
    """One of a request's n samples: its engine request on the worker it lives on now."""
    sequence_id: str
    index: int
    parent: "RequestRecord"
    request: Request
    worker: WorkerRecord
    phase: Phase
    transfer: Transfer | None = None  # the handoff under way, or an orphaned one, or None
    retries: int = 0  # recoveries so far (its worker died, or its transfer failed)
    # Set while a recovered sample waits for a live worker of the role it needs (not on any
    # worker's queue then): when it started waiting.
    stranded_since: float | None = None

    def move(self, to: Phase) -> None:
        if to not in _NEXT[self.phase]:
            raise IllegalPhase(f"sample {self.sequence_id}: {self.phase.value} -> {to.value}")
        self.phase = to

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def stranded(self) -> bool:
        return self.stranded_since is not None

    @property
    def holds_orphan(self) -> bool:
        """Ended, but its send is still out: its blocks stay held until the result."""
        return self.transfer is not None and self.transfer.state is TransferState.ORPHANED


@dataclass(slots=True, eq=False)
class RequestRecord:
    request_id: str
    gateway_id: str
    num_prompt_tokens: int
    params: SamplingParams  # as submitted, max_tokens filled in
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    samples: list[SampleRecord] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(sample.done for sample in self.samples)
