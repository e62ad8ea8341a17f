"""`kvrelay worker --node-rank K` (K > 0): this host's stages of node 0's pipeline, with no gRPC
service of its own (node 0's leader registers and steps for the whole pipeline). The model and
its settings are the leader's; --model here only says where this host keeps the same checkpoint
(checked against the leader's config.json), where its path differs.

The stages run on a thread of their own; the event loop serves /health on --metrics-port (200
once the stages have joined and loaded their layers, 503 before), so the host's supervisor can
tell a running process from a stopped one, which answers nothing (a liveness probe: the leader
gives up on a stage that stops, but only this host's supervisor can end it). A stage's own
progress is the leader's to judge: a step it does not finish fails within the group's timeout. The process returns 0 when the leader stops
the pipeline, EXIT_GROUP_BROKEN when the leader is gone or the group broke: the supervisor
restarts it, and its stages wait at the rendezvous for the leader's next start.
"""
from __future__ import annotations

import asyncio
import threading

from kvrelay.common import metrics
from kvrelay.common.log import get_logger, setup_logging
from kvrelay.common.runtime import run_loop
from kvrelay.worker.rank_group import EXIT_GROUP_BROKEN, placement

log = get_logger(__name__)


def serve_other_node(args) -> int:
    setup_logging(f"worker-node-{args.node_rank}", args.log_level)
    here = placement(args).stages_here(args.pipeline_parallel_size)
    log.info("joining the pipeline's rendezvous", address=args.dist_init_address,
             stages=f"{here.start}-{here.stop - 1} of {args.pipeline_parallel_size}")
    return run_loop(_serve(args))


async def _serve(args) -> int:
    from kvrelay.engine.parallel.followers import serve_stages
    ready = threading.Event()
    server = await metrics.serve_metrics(args.metrics_port, args.host, health=ready.is_set)
    try:
        await asyncio.get_running_loop().run_in_executor(
            None, serve_stages, placement(args), args.pipeline_parallel_size, args.num_threads,
            args.tensor_parallel_timeout, ready.set, args.model)
    except RuntimeError as exc:  # GroupBroken, or the store's DistError: the leader is gone
        log.error("pipeline stages stopped; exiting so they rejoin the leader's next start",
                  reason=str(exc).splitlines()[0])
        return EXIT_GROUP_BROKEN
    finally:
        ready.clear()
        if server is not None:
            server.close()
    log.info("pipeline stopped by its leader")
    return 0
