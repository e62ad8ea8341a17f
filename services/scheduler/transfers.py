"""The PD handoff, one `Transfer` per sample sent from a prefill to a decode worker, and the
`TransferBook` that owns them all.

    RESERVED --sent--> IN_FLIGHT --ok--> DELIVERED --group ready--> ACTIVATED
        |                 |  |  \\--failed--> FAILED       |
        |                 |  \\--sample ended--> ORPHANED --result--> RELEASED
        \\--sample ended--+-------------------------------+--> CANCELLED (before it was sent,
                          |                                        or after it landed)
    any open state --destination lost--> DROPPED;  IN_FLIGHT | ORPHANED --source lost--> LOST;
    RESERVED --source lost--> CANCELLED

RESERVED: blocks are held on the decode worker and the order waits for the prefill worker's next
step. IN_FLIGHT: a step carried the order; until its result comes back the decode blocks stay
held whatever happens to the sample (ORPHANED keeps them once the sample ended), so no page can
land in a block given to someone else. A source lost mid-send may still be writing (a
partition, a stall): its destination blocks are set aside until the order's deadline (LOST).
Samples whose sends one step carried join the decode batch together (the step's group), once
the last of those sends is back and each has its first token. FAILED: the send's bytes may still
be on their way (a sender that gave up, frames left in a buffer of a cut stream), so its
destination blocks are set aside until the deadline, as for LOST. A send that relied on a failed
shared-prefix push while its own was in flight is doomed: its result counts as a failure.

The book only keeps states and indexes; it tells the scheduler core (cluster.py) which
transfers need what, and never calls into it. Illegal transitions raise.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kvrelay.engine.block_pool import KVBlock
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.prefix_hits import first_in_window
from kvrelay.engine.request import Request
from kvrelay.scheduler.messages import SendOrder
from kvrelay.scheduler.registry import WorkerRecord


class TransferState(enum.Enum):
    RESERVED = "reserved"
    IN_FLIGHT = "in flight"
    DELIVERED = "delivered"
    ORPHANED = "orphaned"
    ACTIVATED = "activated"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RELEASED = "released"
    DROPPED = "dropped"
    LOST = "lost"


S = TransferState
_NEXT: dict[TransferState, frozenset[TransferState]] = {
    S.RESERVED: frozenset({S.IN_FLIGHT, S.CANCELLED, S.DROPPED}),
    S.IN_FLIGHT: frozenset({S.DELIVERED, S.FAILED, S.ORPHANED, S.DROPPED, S.LOST}),
    S.DELIVERED: frozenset({S.ACTIVATED, S.CANCELLED, S.DROPPED}),
    S.ORPHANED: frozenset({S.RELEASED, S.DROPPED, S.LOST}),
}
# A result is still due for these: the order went out and nothing has answered it.
_AWAITING_RESULT = frozenset({S.IN_FLIGHT, S.ORPHANED})


class IllegalTransition(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Transfer:
    transfer_id: str
    sequence_id: str
    source: WorkerRecord  # the prefill worker holding the pages
    destination: WorkerRecord  # the decode worker whose blocks are reserved for them
    decode_request: Request  # the sample's engine request on the destination
    # per KV group, the blocks to push and where: pairs, a block of a group moving whole
    src_block_ids: list[list[int]]
    dst_block_ids: list[list[int]]
    transport: str
    deadline: float  # monotonic: no page of the order is written after it
    deadline_unix_ms: int  # the same deadline on the wall clock, for the sender
    state: TransferState = S.RESERVED
    during_step: bool = False
    step_id: int = 0  # the prefill step whose message carried the order
    first_token_out: bool = False  # the source sampled the first token; it may decode
    # transfers of the same step that push leading blocks this one shares
    relies_on: frozenset[str] = frozenset()
    # set when a push it relies on failed while its own was still in flight: its result
    # counts as a failure with this error (its pages may be landing until then)
    doomed: str = ""

    def move(self, to: TransferState) -> None:
        if to not in _NEXT.get(self.state, ()):
            raise IllegalTransition(f"transfer {self.transfer_id}: {self.state.value} -> "
                                    f"{to.value}")
        self.state = to

    @property
    def is_open(self) -> bool:
        return self.state in _NEXT

    @property
    def awaits_result(self) -> bool:
        return self.state in _AWAITING_RESULT

    def order(self) -> SendOrder:
        return SendOrder(
            transfer_id=self.transfer_id, sequence_id=self.sequence_id,
            src_block_ids=_flat(self.src_block_ids),
            dst_address=self.destination.info.push_address,
            dst_block_ids=_flat(self.dst_block_ids), transport=self.transport,
            dst_shm_path=self.destination.info.shm_path if self.transport == "shm" else "",
            during_step=self.during_step, deadline_unix_ms=self.deadline_unix_ms,
            dst_instance_id=self.destination.info.instance_id,
            dst_kv_shards=self.destination.info.tensor_parallel_size)


def _flat(tables: list[list[int]]) -> tuple[int, ...]:
    return tuple(block_id for table in tables for block_id in table)


def pushed_blocks(source: KVCacheManager, destination: KVCacheManager, sequence_id: str,
                  num_tokens: int, num_held: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per KV group, the source and destination blocks of a push of the first `num_tokens`
    tokens' pages, of which the destination holds the first `num_held` blocks: the rest of a
    full-attention group's; of a window group's, only those its window reaches from the next
    token (the destination reserved no others)."""
    num_blocks = -(-num_tokens // destination.block_size)
    src, dst = [], []
    for window, src_table, dst_table in zip(destination.windows,
                                            source.block_ids(sequence_id),
                                            destination.block_ids(sequence_id)):
        first = max(num_held, first_in_window(num_tokens, window, destination.block_size))
        src.append(src_table[first:num_blocks])
        dst.append(dst_table[first:num_blocks])
    return src, dst


@dataclass(slots=True)
class SetAside:
    """Decode blocks a lost prefill worker's send may still write into: held, owned by no
    request, until the send's deadline has passed."""
    worker: WorkerRecord
    blocks: list[KVBlock]
    until: float  # monotonic


@dataclass(slots=True)
class ResultEffects:
    """What the core must do after a send's result."""
    failed: list[tuple[Transfer, str]] = field(default_factory=list)  # end these samples
    released: Transfer | None = None  # an orphan is back: free both of its sides
    group: int | None = None  # the step group that may now be ready


class TransferBook:
    def __init__(self, timeout_s: float, lease_s: float) -> None:
        self.timeout_s = timeout_s
        self.lease_s = lease_s  # a margin past a lost sender's deadline (its own clock)
        self.open: dict[str, Transfer] = {}  # transfer id -> every transfer not yet ended
        self.outbox: dict[str, list[Transfer]] = {}  # source instance id -> RESERVED orders
        self.groups: dict[int, list[Transfer]] = {}  # step id -> the transfers it carried
        self.dependents: dict[str, list[Transfer]] = {}  # transfer id -> who relies on it
        self.set_aside: list[SetAside] = []
        self.num_shared_prefix_tokens = 0  # prompt tokens no transfer had to push
        self._ids = itertools.count()

    # ---- opening and sending -----------------------------------------------------------------
    def open_transfer(self, sequence_id: str, source: WorkerRecord, destination: WorkerRecord,
                      decode_request: Request, num_held: int,
                      transport: str, during_step: bool) -> Transfer:
        """A reservation on the destination for the pages of decode_request's tokens, of which
        it already holds the first `num_held` blocks (a prefix hit: their pages need no
        push)."""
        self.num_shared_prefix_tokens += num_held * source.info.block_size
        src_block_ids, dst_block_ids = pushed_blocks(
            source.core.kv, destination.core.kv, sequence_id, decode_request.num_tokens, num_held)
        transfer = Transfer(
            transfer_id=f"{sequence_id}#{next(self._ids)}", sequence_id=sequence_id, source=source,
            destination=destination, decode_request=decode_request,
            src_block_ids=src_block_ids, dst_block_ids=dst_block_ids,
            transport=transport, deadline=time.monotonic() + self.timeout_s,
            deadline_unix_ms=int((time.time() + self.timeout_s) * 1000),
            # an order reserved outside a step's planning follows the first token
            during_step=during_step, first_token_out=not during_step)
        self.open[transfer.transfer_id] = transfer
        if not during_step:  # otherwise the step being planned carries it
            self.outbox.setdefault(source.info.instance_id, []).append(transfer)
        return transfer

    def has_outgoing(self, worker: WorkerRecord) -> bool:
        return bool(self.outbox.get(worker.info.instance_id))

    def take_outgoing(self, worker: WorkerRecord) -> list[Transfer]:
        return self.outbox.pop(worker.info.instance_id, [])

    def send(self, transfers: list[Transfer], step_id: int) -> list[SendOrder]:
        """These go out with one step: orders whose prompts share leading blocks on their
        decode worker share the push, then each order is frozen."""
        self._share_pushes(transfers)
        for transfer in transfers:
            transfer.move(S.IN_FLIGHT)
            transfer.step_id = step_id
        if transfers:
            self.groups[step_id] = list(transfers)
        return [transfer.order() for transfer in transfers]

    def _share_pushes(self, transfers: list[Transfer]) -> None:
        """Leading blocks shared while in flight (kv_cache_manager.allocate_for_transfer): the
        first order pushes them, the others only the rest of their blocks. They decode only
        once their whole group is back (ready), so after the shared pages are in; if the push
        they rely on fails, they fail with it (result)."""
        pushed: dict[tuple[str, int], str] = {}  # (decode instance, block id) -> its pusher
        for transfer in transfers:
            instance = transfer.destination.info.instance_id
            relies_on, most_shared = set(), 0
            for src, dst in zip(transfer.src_block_ids, transfer.dst_block_ids):  # per group
                num_shared = 0
                while num_shared < len(dst) - 1 and (instance, dst[num_shared]) in pushed:
                    num_shared += 1  # a group's last block is always this order's own to push
                relies_on.update(pushed[(instance, block_id)] for block_id in dst[:num_shared])
                most_shared = max(most_shared, num_shared)
                del dst[:num_shared]
                del src[:num_shared]
            if relies_on:
                transfer.relies_on = frozenset(relies_on)
                for transfer_id in transfer.relies_on:
                    self.dependents.setdefault(transfer_id, []).append(transfer)
                # (tokens: a full-attention group shares the most blocks)
                self.num_shared_prefix_tokens += most_shared * transfer.source.info.block_size
            for dst in transfer.dst_block_ids:
                for block_id in dst:
                    pushed.setdefault((instance, block_id), transfer.transfer_id)

    # ---- events ------------------------------------------------------------------------------
    def result(self, transfer_id: str, ok: bool, error: str) -> ResultEffects:
        transfer = self.open.get(transfer_id)
        if transfer is None or not transfer.awaits_result:
            return ResultEffects()  # ended meanwhile (its worker was lost): nothing to do
        dependents = self.dependents.get(transfer_id, [])
        effects = ResultEffects(group=transfer.step_id)
        if transfer.state is S.ORPHANED:
            self._end(transfer, S.RELEASED)
            effects.released = transfer
        elif ok and not transfer.doomed:
            transfer.move(S.DELIVERED)
        else:
            self._end(transfer, S.FAILED)
            effects.failed.append((transfer, transfer.doomed or f"KV transfer failed: {error}"))
        if not ok:
            for dependent in dependents:
                message = f"KV transfer of a shared prefix failed: {error}"
                if dependent.state is S.IN_FLIGHT:  # its own pages may still be landing
                    dependent.doomed = message
                elif dependent.is_open:
                    effects.failed.append((dependent, message))
        return effects

    def first_token(self, transfer: Transfer) -> None:
        transfer.first_token_out = True

    def ready(self, step_id: int) -> list[Transfer]:
        """The group's delivered transfers whose samples may decode, once no send of the
        group awaits its result: the decode worker then sees the same batches however the
        results interleave, which keeps seeded sampling reproducible (float reductions depend
        on the batch) and spares it steps of one or two rows."""
        group = self.groups.get(step_id)
        if group is None or any(t.awaits_result for t in group):
            return []
        return [t for t in group if t.state is S.DELIVERED and t.first_token_out]

    def activate(self, transfer: Transfer) -> None:
        self._end(transfer, S.ACTIVATED)

    def cancel(self, transfer: Transfer) -> TransferState:
        """The transfer's sample ended. Returns the state it is left in: ORPHANED holds the
        destination's blocks until the result; CANCELLED ones are the caller's to free."""
        if transfer.state is S.IN_FLIGHT:
            transfer.move(S.ORPHANED)
        elif transfer.state in (S.RESERVED, S.DELIVERED):
            self._end(transfer, S.CANCELLED)
        return transfer.state

    def worker_lost(self, worker: WorkerRecord) -> list[Transfer]:
        """Every open transfer from or to the lost worker ends: DROPPED when the destination
        is gone, LOST when the source was mid-send (the caller sets the destination's blocks
        aside), CANCELLED for orders it never got. Returns them; their groups may be ready."""
        ended = []
        for transfer in list(self.open.values()):
            if transfer.destination is worker:
                self._end(transfer, S.DROPPED)
            elif transfer.source is worker and transfer.awaits_result:
                self._end(transfer, S.LOST)
            elif transfer.source is worker and transfer.state is S.RESERVED:
                self._end(transfer, S.CANCELLED)
            else:
                continue
            ended.append(transfer)
        return ended + self._cancel_dependents_of({t.transfer_id for t in ended})

    def _cancel_dependents_of(self, ended_ids: set[str]) -> list[Transfer]:
        """Delivered transfers that rely on a shared-prefix push which ended unwritten: their
        own pages landed, the shared ones never will, so they cannot decode (CANCELLED: no page
        of theirs is in flight, the caller frees their blocks and recovers their samples)."""
        cancelled = []
        for transfer in list(self.open.values()):
            if transfer.state is S.DELIVERED and transfer.relies_on & ended_ids:
                self._end(transfer, S.CANCELLED)
                cancelled.append(transfer)
        return cancelled

    def _end(self, transfer: Transfer, state: TransferState) -> None:
        transfer.move(state)
        del self.open[transfer.transfer_id]
        self.dependents.pop(transfer.transfer_id, None)
        outbox = self.outbox.get(transfer.source.info.instance_id)
        if outbox and transfer in outbox:
            outbox.remove(transfer)  # an order not yet given must never go out
        group = self.groups.get(transfer.step_id)
        if group is not None and transfer in group:
            group.remove(transfer)
            if not group:
                del self.groups[transfer.step_id]

    # ---- set-aside blocks --------------------------------------------------------------------
    def hold_aside(self, transfer: Transfer, blocks: list[KVBlock]) -> None:
        self.set_aside.append(SetAside(transfer.destination, blocks,
                                       transfer.deadline + self.lease_s))

    def due_aside(self, now: float) -> list[SetAside]:
        """The set-aside blocks whose deadline has passed, no longer held by the book."""
        due = [entry for entry in self.set_aside if entry.until <= now]
        if due:
            self.set_aside = [entry for entry in self.set_aside if entry.until > now]
        return due

    # ---- questions ----------------------------------------------------------------------------
    def involves(self, worker: WorkerRecord) -> bool:
        """Does an open transfer still need this worker (a prefill worker's pages are read
        until its send's result)?"""
        return any(t.destination is worker or (t.source is worker and t.awaits_result)
                   for t in self.open.values())

    @property
    def num_open(self) -> int:
        """Orders that went out, or wait to, and have no result yet."""
        return sum(1 for t in self.open.values() if t.state is not S.DELIVERED)
