"""The decode side of the gRPC transport: pushed pages written into this worker's cache. The
blocks were reserved by the scheduler for exactly this transfer, so writing them while a forward
pass runs on other blocks is safe. The KvTransfer servicer (grpc_transport.py) hands each
KvChunk over as a PageChunk."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from kvrelay.common.log import get_logger
from kvrelay.engine.kv_pages import KvPages

log = get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          # 8-bit codes with a scale per row (kernels/kv_quant.py)
          "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True, slots=True)
class PageChunk:
    """One layer of some of a transfer's destination blocks: keys and values each the raw bytes
    of [len(dst_block_ids), block_size, kv_heads, head_dim] in `dtype`."""
    transfer_id: str
    layer: int
    dst_block_ids: tuple[int, ...]
    keys: bytes
    values: bytes
    dtype: str  # torch's name without the prefix: "bfloat16"
    deadline_unix_ms: int  # none of it may be written after this (wall clock; 0: none)
    dst_instance_id: str  # the worker process the pages are for
    last: bool  # the transfer's final chunk


@dataclass(frozen=True, slots=True)
class PushOutcome:
    transfer_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0


class KvReceiver:
    def __init__(self, kv_pages: KvPages | None = None, instance_id: str = "") -> None:
        self.kv_pages = None
        self.num_bytes_received = 0
        if kv_pages is not None:
            self.attach(kv_pages, instance_id)

    def attach(self, kv_pages: KvPages, instance_id: str) -> None:
        self.kv_pages = kv_pages  # this worker's cache, every KV head (a group's too)
        self.page_shape = kv_pages.page_shape
        self.instance_id = instance_id  # this process, as registered with the scheduler

    async def receive(self, chunks: AsyncIterator[PageChunk]) -> PushOutcome:
        """Write one push's chunks as they come; a chunk that cannot be written ends it."""
        if self.kv_pages is None:
            return PushOutcome("", ok=False, error="the model is still loading")
        transfer_id, num_bytes, started, complete = "", 0, time.perf_counter(), False
        try:
            async for chunk in chunks:
                transfer_id = chunk.transfer_id
                num_bytes += self.write(chunk)
                complete = chunk.last
            if not complete:  # a sender that stopped early must not read as a success
                raise ValueError("the push ended before its last chunk")
        except ValueError as exc:
            log.warning("kv push refused", transfer_id=transfer_id, error=str(exc))
            return PushOutcome(transfer_id, ok=False, error=str(exc))
        self.num_bytes_received += num_bytes
        log.debug("kv push received", transfer_id=transfer_id, num_bytes=num_bytes,
                  seconds=time.perf_counter() - started)
        return PushOutcome(transfer_id, ok=True, num_bytes=num_bytes)

    def write(self, chunk: PageChunk) -> int:
        """Raises ValueError for a chunk this cache must not take."""
        if chunk.deadline_unix_ms and time.time() * 1000 >= chunk.deadline_unix_ms:
            # The scheduler holds these blocks only until the deadline (plus a margin).
            raise ValueError("chunk arrived after its transfer's deadline")
        if chunk.dst_instance_id != self.instance_id:
            # Meant for the process this one replaced at the same address: its blocks are not
            # this cache's blocks, which may hold another sequence's pages by now.
            raise ValueError(f"chunk for worker instance {chunk.dst_instance_id!r}, this is "
                             f"{self.instance_id!r}")
        dtype = DTYPES.get(chunk.dtype)
        if dtype != self.kv_pages.dtype:
            raise ValueError(f"dtype {chunk.dtype!r} does not match the cache's "
                             f"{self.kv_pages.dtype}")
        if chunk.layer >= self.kv_pages.num_slots:
            raise ValueError(f"layer {chunk.layer} out of range")
        dst = torch.tensor(chunk.dst_block_ids, dtype=torch.int64)
        if dst.numel() == 0 or int(dst.max()) >= self.kv_pages.num_blocks:
            raise ValueError("destination blocks missing or out of range")
        shape = (len(chunk.dst_block_ids), *self.page_shape)
        keys, values = _tensor(chunk.keys, dtype, shape), _tensor(chunk.values, dtype, shape)
        self.kv_pages.write(chunk.layer, 0, dst, keys)
        self.kv_pages.write(chunk.layer, 1, dst, values)
        return len(chunk.keys) + len(chunk.values)


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    element_size = torch.tensor([], dtype=dtype).element_size()
    expected = element_size
    for size in shape:
        expected *= size
    if len(raw) != expected:
        raise ValueError(f"chunk has {len(raw)} bytes, expected {expected} for {shape}")
    # frombuffer needs a writable buffer; the bytearray is that copy of the message bytes. Bytes
    # first: numpy, under frombuffer, knows neither bfloat16 nor float8.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)
