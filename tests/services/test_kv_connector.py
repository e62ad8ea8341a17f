"""The KV connector's transports for real: a grpc.aio KvTransfer server writing into a
destination cache, the gRPC push from a source cache (all layers at once, or layer by layer from
a compute thread), chunking above 4 MiB, refusals, dead destinations, and the shared-memory
transport into a cache file another mapping reads, layer by layer or landed in one pass."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import grpc
import pytest
import torch

from kvrelay.api.kvrelay.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from kvrelay.engine.kv_groups import KVGroupLayout
from kvrelay.engine.kv_pages import KvPages, map_kv_pages
from kvrelay.engine.model_runner import allocate_kv_cache
from kvrelay.step_messages import SendOrder
from kvrelay.worker.kv_connector import (GrpcKvTransport, KvReceiver, KvSender,
                                          KvTransferService, LayerFeed, ShmKvTransport,
                                          TransferFailed)

GRPC_LIMIT = 4 << 20  # gRPC's default receive limit, which the test server keeps
SMALL = (3, 2, 12, 4, 2, 8)  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
# 8-bit KV caches (kernels/kv_quant.py) move as bytes too: their rows hold codes and a scale
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


class CountingService(KvTransferService):
    """The real servicer, remembering the size of each chunk message it received."""

    def __init__(self, receiver: KvReceiver) -> None:
        super().__init__(receiver)
        self.chunk_sizes: list[int] = []

    async def Push(self, request_iterator, context):
        async def counted():
            async for chunk in request_iterator:
                self.chunk_sizes.append(chunk.ByteSize())
                yield chunk
        return await super().Push(counted(), context)


async def _serve(receiver: KvReceiver | KvTransferService) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()  # default options: messages over 4 MiB are refused
    service = receiver if isinstance(receiver, KvTransferService) else KvTransferService(receiver)
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _cache(shape, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Compare bit for bit (float32, bfloat16 and 8-bit codes alike, NaN-safe)."""
    integer = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[tensor.element_size()]
    return tensor.view(integer)


def _order(src: list[int], dst: list[int], address: str = "", transport: str = "grpc",
           shm_path: str = "", deadline_unix_ms: int = 0) -> SendOrder:
    return SendOrder(transfer_id="t1", sequence_id="r/0", src_block_ids=tuple(src),
                     dst_address=address, dst_block_ids=tuple(dst), transport=transport,
                     dst_shm_path=shm_path, during_step=False,
                     deadline_unix_ms=deadline_unix_ms, dst_instance_id="")


def _assert_moved(source: torch.Tensor, destination: torch.Tensor, before: torch.Tensor,
                  src: list[int], dst: list[int]) -> None:
    """The destination blocks hold the source blocks exactly; every other block is as before."""
    assert torch.equal(_bits(destination[:, :, dst]), _bits(source[:, :, src]))
    others = [b for b in range(destination.shape[2]) if b not in dst]
    assert torch.equal(_bits(destination[:, :, others]), _bits(before[:, :, others]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- gRPC --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer_by_layer", [False, True])
def test_grpc_push_copies_the_blocks_bit_for_bit(dtype, layer_by_layer):
    source, destination = _cache(SMALL, dtype, 1), _cache(SMALL, dtype, 2)
    before = destination.clone()
    src, dst = [5, 0, 7, 3], [11, 2, 6, 9]

    async def scenario():
        server, address = await _serve(KvReceiver(KvPages.whole(destination)))
        transport = GrpcKvTransport()
        feed = LayerFeed(KvPages.whole(source), src, asyncio.get_running_loop())
        try:
            if layer_by_layer:  # as the compute thread does while the forward pass runs
                thread = threading.Thread(target=_layers_done, args=(feed,))
                thread.start()
                num_bytes = await transport.push(_order(src, dst, address), feed)
                thread.join()
            else:
                feed.fill_now()
                num_bytes = await transport.push(_order(src, dst, address), feed)
        finally:
            await transport.close()
            await server.stop(None)
        return num_bytes

    num_bytes = asyncio.run(scenario())
    _assert_moved(source, destination, before, src, dst)
    assert num_bytes == source[:, :, src].numel() * source.element_size()


@pytest.mark.parametrize("dst_instance", ["worker-before-restart", "worker-now"])
def test_grpc_push_lands_only_in_the_worker_instance_it_was_ordered_for(dst_instance):
    """A decode worker replaced at the same address (a restarted container) must not take the
    pages that were on their way to the process it replaced: its blocks hold other sequences."""
    source, destination = _cache(SMALL, torch.float32, 1), _cache(SMALL, torch.float32, 2)
    before = destination.clone()
    src, dst = [5, 0], [11, 2]

    async def scenario():
        server, address = await _serve(KvReceiver(KvPages.whole(destination),
                                                   instance_id="worker-now"))
        transport = GrpcKvTransport()
        feed = LayerFeed(KvPages.whole(source), src, asyncio.get_running_loop())
        feed.fill_now()
        order = dataclasses.replace(_order(src, dst, address), dst_instance_id=dst_instance)
        try:
            await transport.push(order, feed)
        finally:
            await transport.close()
            await server.stop(None)

    if dst_instance == "worker-now":
        asyncio.run(scenario())
        _assert_moved(source, destination, before, src, dst)
    else:
        with pytest.raises(TransferFailed, match="instance"):
            asyncio.run(scenario())
        assert torch.equal(_bits(destination), _bits(before))


def _layers_done(feed: LayerFeed) -> None:
    for layer in range(feed.num_layers):
        time.sleep(0.01)
        feed.on_layer_done(layer)


def test_grpc_push_above_4_mib_per_layer_goes_in_chunks_under_the_limit():
    shape = (2, 2, 96, 16, 4, 128)  # 64 KiB of K+V per block and layer
    source, destination = _cache(shape, torch.float32, 3), _cache(shape, torch.float32, 4)
    before = destination.clone()
    src = list(range(80))  # 5 MiB per layer
    dst = list(range(95, 15, -1))
    service = CountingService(KvReceiver(KvPages.whole(destination)))

    async def scenario():
        server, address = await _serve(service)
        transport = GrpcKvTransport()
        feed = LayerFeed(KvPages.whole(source), src, asyncio.get_running_loop())
        feed.fill_now()
        try:
            await transport.push(_order(src, dst, address), feed)
        finally:
            await transport.close()
            await server.stop(None)

    asyncio.run(scenario())
    _assert_moved(source, destination, before, src, dst)
    assert len(service.chunk_sizes) >= 2 * 2  # at least two chunks per layer
    assert max(service.chunk_sizes) < GRPC_LIMIT


@pytest.mark.parametrize("problem", ["dtype", "block-out-of-range", "layer-out-of-range"])
def test_grpc_push_the_receiver_cannot_write_fails(problem):
    destination = _cache(SMALL, torch.float32, 2)
    before = destination.clone()
    source_shape = (SMALL[0] + 1, *SMALL[1:]) if problem == "layer-out-of-range" else SMALL
    source = _cache(source_shape, torch.bfloat16 if problem == "dtype" else torch.float32, 1)
    dst = [1, SMALL[2]] if problem == "block-out-of-range" else [1, 2]

    async def scenario():
        server, address = await _serve(KvReceiver(KvPages.whole(destination)))
        transport = GrpcKvTransport()
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        feed.fill_now()
        try:
            with pytest.raises(TransferFailed, match="refused"):
                await transport.push(_order([0, 1], dst, address), feed)
        finally:
            await transport.close()
            await server.stop(None)

    asyncio.run(scenario())
    if problem != "layer-out-of-range":  # refused at the first chunk: nothing written
        assert torch.equal(_bits(destination), _bits(before))


def test_sender_reports_a_dead_destination_as_a_failed_result_within_its_timeout():
    source = _cache(SMALL, torch.float32, 1)
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there

    async def scenario():
        transport = GrpcKvTransport()
        sender = KvSender({"grpc": transport}, timeout_s=3.0)
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        feed.fill_now()
        started = time.monotonic()
        try:
            result = await sender.send(_order([0, 1], [2, 3], address), feed)
        finally:
            await transport.close()
        return result, time.monotonic() - started

    result, seconds = asyncio.run(scenario())
    assert not result.ok and result.transfer_id == "t1" and result.error
    assert seconds < 3.0 + 1.0


def test_sender_times_out_a_send_whose_layers_never_come():
    """The forward pass that should feed a during-step send stalls: the send must still end."""
    source, destination = _cache(SMALL, torch.float32, 1), _cache(SMALL, torch.float32, 2)

    async def scenario():
        server, address = await _serve(KvReceiver(KvPages.whole(destination)))
        transport = GrpcKvTransport()
        sender = KvSender({"grpc": transport}, timeout_s=0.5)
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        feed.on_layer_done(0)  # the rest of the layers never come
        started = time.monotonic()
        try:
            result = await sender.send(_order([0, 1], [2, 3], address), feed)
        finally:
            await transport.close()
            await server.stop(None)
        return result, time.monotonic() - started

    result, seconds = asyncio.run(scenario())
    assert not result.ok and "timed out" in result.error
    assert 0.5 <= seconds < 2.0


def test_sender_fails_a_send_whose_forward_pass_failed():
    source, destination = _cache(SMALL, torch.float32, 1), _cache(SMALL, torch.float32, 2)

    async def scenario():
        server, address = await _serve(KvReceiver(KvPages.whole(destination)))
        transport = GrpcKvTransport()
        sender = KvSender({"grpc": transport}, timeout_s=5.0)
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        feed.on_layer_done(0)
        feed.fail(RuntimeError("out of memory"))
        try:
            return await sender.send(_order([0, 1], [2, 3], address), feed)
        finally:
            await transport.close()
            await server.stop(None)

    result = asyncio.run(scenario())
    assert not result.ok and "out of memory" in result.error


# ---- shared memory -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_shm_push_lands_in_the_destination_file(tmp_path, dtype):
    path = str(tmp_path / "decode.kv")
    destination = allocate_kv_cache(SMALL, dtype, torch.device("cpu"), path)
    destination.copy_(_cache(SMALL, dtype, 2))
    before = destination.clone()
    source = _cache(SMALL, dtype, 1)
    layers, _, _, block_size, kv_heads, head_dim = SMALL
    src, dst = [4, 0, 8], [10, 1, 5]

    async def scenario():
        transport = ShmKvTransport((layers, block_size, kv_heads, head_dim), dtype)
        sender = KvSender({"shm": transport}, timeout_s=5.0)
        feed = LayerFeed(KvPages.whole(source), src, asyncio.get_running_loop())
        thread = threading.Thread(target=_layers_done, args=(feed,))
        thread.start()
        result = await sender.send(_order(src, dst, transport="shm", shm_path=path), feed)
        thread.join()
        return result

    result = asyncio.run(scenario())
    assert result.ok, result.error
    assert result.num_bytes == source[:, :, src].numel() * source.element_size()
    _assert_moved(source, destination, before, src, dst)  # the decode worker's own mapping
    reader = map_kv_pages(path, dtype, (layers, block_size, kv_heads, head_dim)).shards[0]
    assert reader.shape == destination.shape
    _assert_moved(source, reader, before, src, dst)  # and a fresh one


@pytest.mark.parametrize("problem", ["block-out-of-range", "no-file", "no-path"])
def test_shm_push_that_cannot_land_fails(tmp_path, problem):
    path = str(tmp_path / "decode.kv")
    if problem != "no-file":
        allocate_kv_cache(SMALL, torch.float32, torch.device("cpu"), path)
    source = _cache(SMALL, torch.float32, 1)
    layers, _, num_blocks, block_size, kv_heads, head_dim = SMALL
    dst = [0, num_blocks] if problem == "block-out-of-range" else [0, 1]

    async def scenario():
        transport = ShmKvTransport((layers, block_size, kv_heads, head_dim), torch.float32)
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        feed.fill_now()
        order = _order([0, 1], dst, transport="shm",
                       shm_path="" if problem == "no-path" else path)
        result = await KvSender({"shm": transport}, timeout_s=5.0).send(order, feed)
        with pytest.raises(TransferFailed):
            await transport.push(order, feed)
        return result

    result = asyncio.run(scenario())
    assert not result.ok and result.error


# ---- shared memory, landed in one pass ---------------------------------------------------------
def _landing(path: str, dtype, source: torch.Tensor, order) -> tuple[ShmKvTransport, KvSender,
                                                                     LayerFeed]:
    layers, _, _, block_size, kv_heads, head_dim = SMALL
    transport = ShmKvTransport((layers, block_size, kv_heads, head_dim), dtype)
    sender = KvSender({"shm": transport}, timeout_s=5.0)
    feed = LayerFeed(KvPages.whole(source), list(order.src_block_ids), asyncio.get_running_loop(),
                     sender.lander(order))
    return transport, sender, feed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("on_compute_thread", [False, True])
def test_shm_landing_writes_the_final_pages_before_the_source_blocks_are_let_go(
        tmp_path, dtype, on_compute_thread):
    """A lander copies the pages straight into the destination when the step's KV is final
    (fill_now on the event loop, or land on the compute thread right after the pass): once that
    returns, the scheduler may give the source blocks to the next step, which overwrites them."""
    path = str(tmp_path / "decode.kv")
    destination = allocate_kv_cache(SMALL, dtype, torch.device("cpu"), path)
    destination.copy_(_cache(SMALL, dtype, 2))
    before, source = destination.clone(), _cache(SMALL, dtype, 1)
    original = source.clone()
    src, dst = [4, 0, 8], [10, 1, 5]
    order = _order(src, dst, transport="shm", shm_path=path)

    async def scenario():
        _, sender, feed = _landing(path, dtype, source, order)
        assert feed.lander is not None
        if on_compute_thread:
            thread = threading.Thread(target=feed.land)
            thread.start()
            thread.join()
        feed.fill_now()  # lands now, or is a no-op after the compute thread's landing
        source.fill_(7.0)  # the next step reuses the source blocks
        return await sender.send(order, feed)

    result = asyncio.run(scenario())
    assert result.ok, result.error
    assert result.num_bytes == original[:, :, src].numel() * original.element_size()
    _assert_moved(original, destination, before, src, dst)
    reader = map_kv_pages(path, dtype, (SMALL[0], SMALL[3], SMALL[4], SMALL[5])).shards[0]
    _assert_moved(original, reader, before, src, dst)


@pytest.mark.parametrize("problem", ["block-out-of-range", "no-file", "no-path", "deadline",
                                     "forward-pass"])
def test_shm_landing_that_cannot_land_fails_the_send_and_writes_nothing(tmp_path, problem):
    path = str(tmp_path / "decode.kv")
    destination = None
    if problem != "no-file":
        destination = allocate_kv_cache(SMALL, torch.float32, torch.device("cpu"), path)
    before = None if destination is None else destination.clone()
    dst = [0, SMALL[2]] if problem == "block-out-of-range" else [2, 3]
    order = _order([0, 1], dst, transport="shm", shm_path="" if problem == "no-path" else path,
                   deadline_unix_ms=_deadline_in(-0.001) if problem == "deadline" else 0)

    async def scenario():
        _, sender, feed = _landing(path, torch.float32, _cache(SMALL, torch.float32, 1), order)
        if problem == "forward-pass":
            feed.fail(RuntimeError("out of memory"))
        else:
            feed.fill_now()
        return await sender.send(order, feed)

    result = asyncio.run(scenario())
    assert not result.ok and result.error
    if problem in ("deadline", "forward-pass"):
        assert ("deadline" if problem == "deadline" else "out of memory") in result.error
    if destination is not None:
        assert torch.equal(_bits(destination), _bits(before))


# ---- deadlines --------------------------------------------------------------------------------------
def _deadline_in(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)


def _shm_caches(tmp_path) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode cache file, its mapping, a copy of what it held, and a source cache."""
    path = str(tmp_path / "decode.kv")
    destination = allocate_kv_cache(SMALL, torch.float32, torch.device("cpu"), path)
    destination.copy_(_cache(SMALL, torch.float32, 2))
    return path, destination, destination.clone(), _cache(SMALL, torch.float32, 1)


@pytest.mark.parametrize("transport_name", ["grpc", "shm"])
def test_a_send_past_its_deadline_writes_nothing(tmp_path, transport_name):
    """The scheduler may have given the destination blocks to another request by then."""
    path, destination, before, source = _shm_caches(tmp_path)
    layers, _, _, block_size, kv_heads, head_dim = SMALL

    async def scenario():
        server, address = await _serve(KvReceiver(KvPages.whole(destination)))
        transports = {"grpc": GrpcKvTransport(),
                      "shm": ShmKvTransport((layers, block_size, kv_heads, head_dim),
                                            torch.float32)}
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        feed.fill_now()
        order = _order([0, 1], [2, 3], address, transport_name, path, _deadline_in(-0.001))
        try:
            return await KvSender(transports, timeout_s=5.0).send(order, feed)
        finally:
            await transports["grpc"].close()
            await server.stop(None)

    result = asyncio.run(scenario())
    assert not result.ok and "deadline" in result.error
    assert torch.equal(_bits(destination), _bits(before))


def test_shm_send_stops_writing_at_its_deadline(tmp_path):
    """Layers that come after the deadline are not written, even by a sender no one heard
    from since (the scheduler frees the blocks soon after)."""
    path, destination, before, source = _shm_caches(tmp_path)
    layers, _, _, block_size, kv_heads, head_dim = SMALL

    async def scenario():
        transport = ShmKvTransport((layers, block_size, kv_heads, head_dim), torch.float32)
        feed = LayerFeed(KvPages.whole(source), [0, 1], asyncio.get_running_loop())
        order = _order([0, 1], [2, 3], transport="shm", shm_path=path,
                       deadline_unix_ms=_deadline_in(0.3))
        feed.on_layer_done(0)
        push = asyncio.create_task(transport.push(order, feed))
        await asyncio.sleep(0.5)  # the compute thread is slow: the deadline passes
        for layer in range(1, layers):
            feed.on_layer_done(layer)
        with pytest.raises(TransferFailed, match="deadline"):
            await push

    asyncio.run(scenario())
    assert torch.equal(_bits(destination[0][:, [2, 3]]), _bits(source[0][:, [0, 1]]))
    assert torch.equal(_bits(destination[1:]), _bits(before[1:]))


def test_receiver_refuses_chunks_after_their_deadline():
    destination = _cache(SMALL, torch.float32, 2)
    before = destination.clone()
    service = KvTransferService(KvReceiver(KvPages.whole(destination)))
    _, _, _, block_size, kv_heads, head_dim = SMALL
    pages = torch.zeros((1, block_size, kv_heads, head_dim))

    async def chunks():
        yield kv_transfer_pb2.KvChunk(
            transfer_id="t1", layer=0, dst_block_ids=[2], keys=pages.numpy().tobytes(),
            values=pages.numpy().tobytes(), dtype="float32", last=True,
            deadline_unix_ms=_deadline_in(-0.001))

    ack = asyncio.run(service.Push(chunks(), None))
    assert not ack.ok and "deadline" in ack.error
    assert torch.equal(_bits(destination), _bits(before))


def test_a_feed_streams_each_slot_in_order_once_its_last_layer_has_run():
    # layers 0-1 full attention, 2-4 one window: two slots per block (slot 0: layers 0, 2, 4;
    # slot 1: layers 1, 3), so nothing is final before layer 4 has run
    layout = KVGroupLayout.from_windows([0, 0, 8, 8, 8])
    cache = torch.randn(layout.slots_per_block, 2, 6, 4, 2, 8)
    src = [4, 1]

    async def scenario():
        feed = LayerFeed(KvPages.whole(cache), src, asyncio.get_running_loop(),
                         slots_done_after=layout.slots_done_after())
        done = []
        for layer in range(layout.num_layers):
            feed.on_layer_done(layer)
            await asyncio.sleep(0)
            done.append(feed.queue.qsize())
        return done, [item async for item in feed.layers()]

    done, slots = asyncio.run(scenario())
    assert done == [0, 0, 0, 0, 2]
    assert [slot for slot, _ in slots] == [0, 1]
    for slot, pages in slots:
        assert torch.equal(pages, cache[slot][:, src])
