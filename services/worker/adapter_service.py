"""The worker's LoRA calls (Worker.LoadAdapter / UnloadAdapter), for the scheduler.

An adapter is read and checked on a thread of its own, beside the steps (a file of a few MB;
the thread runs its torch ops inline, so no second OpenMP pool starts: omp_threads.py); it is
added to the runner's slots, and retired from them, on the compute thread, between steps.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvrelay.common.log import get_logger
from kvrelay.engine.lora.adapter_files import AdapterError, read_adapter
from kvrelay.engine.omp_threads import run_torch_ops_inline

log = get_logger(__name__)


class AdapterCalls:
    def __init__(self, service) -> None:
        self.service = service  # the WorkerService: its executor (runner) and compute thread
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read",
                                         initializer=run_torch_ops_inline)

    def _slots(self):
        executor = self.service.executor
        return None if executor is None else executor.runner.lora

    async def load(self, request, context) -> None:
        slots = self._slots()
        if slots is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is off on this worker (start it with --enable-lora)")
        if request.adapter_id in slots.adapters:
            return  # loaded before this worker registered again
        loop = asyncio.get_running_loop()
        spec = self.service.executor.runner.model.spec
        try:
            adapter = await loop.run_in_executor(self.reader, read_adapter, request.path, spec,
                                                 slots.max_rank)
        except AdapterError as exc:
            log.warning("lora adapter refused", lora=request.name, reason=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await loop.run_in_executor(self.service.compute, slots.add, request.adapter_id, adapter)
        log.info("lora adapter loaded", lora=request.name, adapter_id=request.adapter_id,
                 rank=adapter.rank, num_modules=len(adapter.modules))

    async def unload(self, request, context) -> None:
        slots = self._slots()
        if slots is not None:
            await asyncio.get_running_loop().run_in_executor(self.service.compute, slots.retire,
                                                             request.adapter_id)
