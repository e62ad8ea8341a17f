"""The LoRA adapters a scheduler serves, kept loaded on every one of its workers.

Each load reaches every live worker (each reads the PEFT directory and checks it against its
model) and is registered only if all of them took it; a worker that registers later loads
every registered adapter before it takes requests. So any worker can run any adapter's
request, and placement (prefill, decode, recovery) needs no adapter rule. Changes and worker
syncs take one lock, so none interleave. Unloading stops new requests at once; the workers
are told to drop the weights only once no sample of the scheduler holds the adapter (a sample
recovered onto another worker after its own died still finds it there).
"""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import worker_pb2, worker_pb2_grpc
from kvrelay.common.grpc_server import channel
from kvrelay.common.log import get_logger
from kvrelay.engine.lora.catalog import AdapterCatalog, AdapterRef
from kvrelay.scheduler.messages import WorkerInfo

log = get_logger(__name__)
LOAD_TIMEOUT_S = 120.0  # a worker reads and checks the adapter within this


class AdapterRefused(ValueError):
    """An adapter no worker of this scheduler may serve; the message says why."""


class AdapterDirectory:
    def __init__(self, enabled: bool, modules: dict[str, str], max_adapters: int) -> None:
        self.enabled = enabled
        self.catalog = AdapterCatalog(max_adapters)
        self.lock = asyncio.Lock()
        # unloaded, still held by samples: id -> ref (workers keep it, new ones load it too)
        self.retired: dict[int, AdapterRef] = {}
        for name, path in modules.items():  # checked by each worker as it registers
            self.catalog.check_new(name)
            self.catalog.add(name, path)

    def resolve(self, name: str) -> int:
        """The adapter id for a request naming `name`; KeyError when none is loaded."""
        ref = self.catalog.get(name)
        if ref is None:
            raise KeyError(name)
        return ref.adapter_id

    def names(self) -> dict[int, str]:
        return {ref.adapter_id: ref.name for ref in self.catalog.refs()}

    async def load(self, name: str, path: str, workers: list[WorkerInfo]) -> AdapterRef:
        if not self.enabled:
            raise AdapterRefused("LoRA is off: start the scheduler and workers with "
                                 "--enable-lora")
        async with self.lock:
            self.catalog.check_new(name)  # ValueError: taken, malformed, full
            ref = AdapterRef(self.catalog.next_id(), name, path)
            done = []
            try:
                for info in workers:
                    await _load_on(info, ref)
                    done.append(info)
            except AdapterRefused:
                await asyncio.gather(*(_unload_on(info, ref.adapter_id) for info in done))
                raise
            self.catalog.add(name, path, ref.adapter_id)
        log.info("lora adapter loaded", lora=name, adapter_id=ref.adapter_id,
                 num_workers=len(workers))
        return ref

    def unload(self, name: str) -> None:
        """New requests can no longer name it (KeyError: unknown); `release` drops it from
        the workers once no sample holds it."""
        ref = self.catalog.remove(name)
        self.retired[ref.adapter_id] = ref
        log.info("lora adapter unloaded", lora=name, adapter_id=ref.adapter_id)

    async def release(self, held: set[int], workers: list[WorkerInfo]) -> None:
        """Tell the workers to drop the retired adapters no sample holds any more."""
        async with self.lock:
            for adapter_id in [i for i in self.retired if i not in held]:
                ref = self.retired.pop(adapter_id)
                await asyncio.gather(*(_unload_on(info, adapter_id) for info in workers))
                log.info("lora adapter released", lora=ref.name, adapter_id=adapter_id)

    async def sync_worker(self, info: WorkerInfo) -> None:
        """Before a worker joins: every registered adapter loaded on it, and every retired one
        samples still hold (AdapterRefused)."""
        if not self.catalog.refs() and not self.retired:
            return
        async with self.lock:
            for ref in [*self.catalog.refs(), *self.retired.values()]:
                await _load_on(info, ref)


async def _load_on(info: WorkerInfo, ref: AdapterRef) -> None:
    if not info.max_loras:
        raise AdapterRefused(f"worker {info.worker_id} runs without --enable-lora")
    try:
        async with channel(info.address, "worker") as chan:
            await worker_pb2_grpc.WorkerStub(chan).LoadAdapter(worker_pb2.LoadAdapterRequest(
                adapter_id=ref.adapter_id, name=ref.name, path=ref.path),
                timeout=LOAD_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise AdapterRefused(f"adapter {ref.name!r}: {error.details()}") from None
        raise AdapterRefused(f"adapter {ref.name!r} could not be loaded on worker "
                             f"{info.worker_id}: {error.code().name} {error.details()}") from None


async def _unload_on(info: WorkerInfo, adapter_id: int) -> None:
    try:
        async with channel(info.address, "worker") as chan:
            await worker_pb2_grpc.WorkerStub(chan).UnloadAdapter(
                worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id), timeout=LOAD_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:  # a dead worker holds nothing; others drop it
        log.warning("adapter unload failed", worker_id=info.worker_id, adapter_id=adapter_id,
                    code=error.code().name)


def adapter_use(workers) -> dict[int, tuple[int, int]]:
    """adapter id -> (its requests running on a worker, those waiting), over live workers."""
    use: dict[int, list[int]] = {}
    for worker in workers:
        for column, requests in ((0, worker.core.running), (1, worker.core.waiting)):
            for request in requests:
                if request.adapter_id:
                    use.setdefault(request.adapter_id, [0, 0])[column] += 1
    return {adapter_id: (running, waiting) for adapter_id, (running, waiting) in use.items()}
