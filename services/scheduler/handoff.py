"""The PD handoff: reserve blocks on a decode worker, order the prefill worker to push the
prompt's pages into them, and move the sample to the decode worker once they have arrived.

States (records.Phase): PREFILL -> TRANSFER -> DECODE. A send that reached the prefill worker
holds the decode worker's blocks until its result comes back, whatever happens to the request
meanwhile, or, if its worker is lost, until the order's deadline (cluster.py), so a late write
can never land in a block that was given to someone else. The prefill side's pages are copied
out during the step that carries the order.
"""
from __future__ import annotations

import itertools
import time

from services.api.kvrelay.v1 import common_pb2, worker_pb2
from services.engine.request import Request
from services.scheduler.deltas import finish_delta
from services.scheduler.records import DECODE, Phase, SampleRecord, WorkerRecord

_transfer_ids = itertools.count()


def reserve(cluster, sample: SampleRecord, during_step: bool) -> worker_pb2.KvSendOrder | None:
    """Reserve decode-side blocks for the sample's prompt; the send order, or None if no
    decode worker has room now."""
    request = sample.request
    for decode in sorted(cluster.live(DECODE), key=_decode_preference):
        # The prefill side's salt: prompts that share a prefix share its blocks on the decode
        # worker too, and blocks it already holds are not pushed again (kv_cache_manager.py).
        clone = Request(sample.seq_id, request.prompt_token_ids, request.params,
                        request.eos_token_ids, request.priority, request.arrival_time,
                        request.cache_salt)
        num_held = decode.core.reserve_for_transfer(clone)
        if num_held is not None:
            sample.decode_request, sample.decode_worker = clone, decode
            return _order(cluster, sample, during_step, num_held)
    return None


def _decode_preference(worker: WorkerRecord) -> tuple:
    return (-worker.core.kv.num_free_blocks, len(worker.core.running))


def _order(cluster, sample: SampleRecord, during_step: bool,
           num_held: int) -> worker_pb2.KvSendOrder:
    """The push of the prompt's pages, but for the `num_held` leading blocks the decode worker
    has already."""
    prefill, decode = sample.worker, sample.decode_worker
    num_blocks = -(-sample.request.num_prompt_tokens // prefill.info.block_size)
    transfer_id = f"{sample.seq_id}#{next(_transfer_ids)}"
    sample.transfer_id = transfer_id
    cluster.transfers[transfer_id] = sample
    transport = _transport(cluster.kv_transport, prefill, decode)
    cluster.num_transfer_shared_prefix_tokens += num_held * prefill.info.block_size
    sample.send_deadline = time.monotonic() + cluster.transfer_timeout_s
    return worker_pb2.KvSendOrder(
        transfer_id=transfer_id, seq_id=sample.seq_id,
        src_block_ids=prefill.core.kv.block_ids(sample.seq_id)[num_held:num_blocks],
        dst_address=decode.info.address,
        dst_block_ids=decode.core.kv.block_ids(sample.seq_id)[num_held:], transport=transport,
        dst_shm_path=decode.info.shm_path if transport == "shm" else "",
        during_step=during_step,
        deadline_unix_ms=int((time.time() + cluster.transfer_timeout_s) * 1000),
        dst_instance_id=decode.info.instance_id)


def share_pushes(cluster, orders: list[worker_pb2.KvSendOrder]) -> None:
    """Orders of one step whose prompts share leading blocks on their decode worker (shared
    while in flight, see kv_cache_manager.allocate_for_transfer): the first order pushes them,
    the others only the rest of their blocks. A step's samples join the decode batch together
    once every send of the step is back (_activate_step_group), so none decodes before the
    shared pages are in; if the push they rely on fails, they fail with it (on_send_result)."""
    pushed: dict[tuple[str, int], str] = {}  # (decode worker, block id) -> transfer pushing it
    for order in orders:
        dst = order.dst_block_ids
        num_shared = 0
        while num_shared < len(dst) - 1 and (order.dst_address, dst[num_shared]) in pushed:
            num_shared += 1  # the last block is always this order's own to push
        if num_shared:
            sample = cluster.transfers[order.transfer_id]
            sample.relies_on = frozenset(
                pushed[(order.dst_address, block_id)] for block_id in dst[:num_shared])
            cluster.num_transfer_shared_prefix_tokens += num_shared * sample.worker.info.block_size
            del order.dst_block_ids[:num_shared]
            del order.src_block_ids[:num_shared]
        for block_id in order.dst_block_ids:
            pushed.setdefault((order.dst_address, block_id), order.transfer_id)


def _transport(preferred: str, prefill: WorkerRecord, decode: WorkerRecord) -> str:
    same_host = prefill.info.host_id and prefill.info.host_id == decode.info.host_id
    if (preferred == "shm" and same_host and decode.info.shm_path
            and "shm" in prefill.info.kv_transports):
        return "shm"
    return "grpc"


def after_first_token(cluster, sample: SampleRecord) -> None:
    """The prefill worker sampled the first token and the sample goes on: leave the prefill
    worker's running batch and send the pages (now, or once a decode worker has room)."""
    sample.worker.core.detach_for_transfer(sample.request)
    sample.phase = Phase.TRANSFER
    if sample.pages_delivered:
        _activate_step_group(cluster, sample.send_step)
    elif sample.transfer_id is None:
        order = reserve(cluster, sample, during_step=False)
        if order is None:
            cluster.awaiting_decode.append(sample)
        else:
            sample.worker.pending_sends.append(order)
            cluster.on_work(sample.worker)


def retry_awaiting(cluster) -> None:
    """Blocks were freed somewhere: place samples still waiting for a decode worker."""
    while cluster.awaiting_decode:
        sample = cluster.awaiting_decode[0]
        order = reserve(cluster, sample, during_step=False)
        if order is None:
            return
        cluster.awaiting_decode.pop(0)
        sample.worker.pending_sends.append(order)
        cluster.on_work(sample.worker)


def on_send_result(cluster, result: worker_pb2.KvSendResult) -> None:
    sample = cluster.transfers.pop(result.transfer_id, None)
    if sample is None:
        return  # its worker died and the sample was already cleaned up
    sample.send_in_flight = False
    if sample.phase is Phase.DONE:  # finished or aborted while the pages were in flight
        cluster.release_ended(sample)
    elif not result.ok:
        cluster.end_sample(sample, finish_delta(sample, common_pb2.FINISH_REASON_ERROR,
                                                f"KV transfer failed: {result.error}"))
    else:  # before its step's result is applied (layer by layer), or after
        sample.pages_delivered = True
    if not result.ok:
        _fail_relying(cluster, result.transfer_id, result.error)
    _activate_step_group(cluster, sample.send_step)  # this result may have been the last
    retry_awaiting(cluster)


def _fail_relying(cluster, transfer_id: str, error: str) -> None:
    """The samples whose shared leading blocks that failed transfer was to fill. A send goes
    out during its step, so its result can come before the step's own: a sample may still be
    in PREFILL here, and would otherwise join the decode batch with those blocks unfilled."""
    for sample in list(cluster.samples.values()):
        if transfer_id in sample.relies_on and sample.phase in (Phase.PREFILL, Phase.TRANSFER):
            cluster.end_sample(sample, finish_delta(
                sample, common_pb2.FINISH_REASON_ERROR,
                f"KV transfer of a shared prefix failed: {error}"))


def _activate_step_group(cluster, send_step: int) -> None:
    """Samples whose sends one prefill step ordered join the decode batch together, once the
    last of those sends is back: the decode worker then sees the same batches however the
    sends' results interleave, which keeps seeded sampling reproducible (float reductions
    depend on the batch) and spares it steps of one or two rows."""
    if any(s.send_step == send_step for s in cluster.transfers.values() if s.send_in_flight):
        return
    ready = [s for s in cluster.samples.values() if s.send_step == send_step
             and s.phase is Phase.TRANSFER and s.pages_delivered]
    for sample in ready:
        _activate(cluster, sample)


def activate_waiting_groups(cluster) -> None:
    """After sends vanished without a result (a dead worker), release the groups they held."""
    steps = {s.send_step for s in cluster.samples.values()
             if s.phase is Phase.TRANSFER and s.pages_delivered}
    for send_step in steps:
        _activate_step_group(cluster, send_step)


def _activate(cluster, sample: SampleRecord) -> None:
    prefill, decode = sample.worker, sample.decode_worker
    prefill.core.release_transferred(sample.request)
    cluster.forget_on(prefill, sample.seq_id)
    clone = sample.decode_request
    for token_id in sample.request.output_token_ids:
        clone.append_token(token_id)
    decode.core.activate_transferred(clone)
    sample.phase = Phase.DECODE
    cluster.on_work(decode)
    cluster.on_work(prefill)
