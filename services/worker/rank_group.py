"""A worker as a rank group on one host: a tensor-parallel group (`--tensor-parallel-size N`)
or a pipeline (`--pipeline-parallel-size N`). This process is rank 0 (stage 0), the leader, and
starts ranks 1..N-1 (engine/parallel/followers.py). The scheduler sees one worker: the leader
registers, steps, samples and moves KV pages for all; the group's KV cache lives in one shared
file which the leader maps whole: a tensor-parallel rank's heads in a region of its own
(engine/parallel/group_kv.py), a stage's layers in their slots (engine/parallel/stage_kv.py).

The group lives and dies as one. A follower that dies, or a rank that stalls in a step past
--tensor-parallel-timeout, leaves the group unable to compute: the leader exits at once with
EXIT_GROUP_BROKEN (its followers die with it), its requests are recovered by the scheduler as for
any lost worker (re-prefilled elsewhere), and the supervisor (`kvrelay up`, Kubernetes)
restarts the whole group.
"""
from __future__ import annotations

import os
import sys

from kvrelay.common.log import get_logger
from kvrelay.engine.parallel.partition import parse_partition

log = get_logger(__name__)
EXIT_GROUP_BROKEN = 70  # EX_SOFTWARE


def check_group_flags(args) -> None:
    """SystemExit with the reason where the flags cannot make a group."""
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        size = getattr(args, flag[2:].replace("-", "_"))
        if size < 1:
            sys.exit(f"{flag} must be >= 1, got {size}")
        if size > 1 and args.device == "cuda":
            sys.exit(f"{flag} > 1: a worker's rank group runs on CPU for now (its KV cache is "
                     "a shared file its leader maps); on CUDA run one rank a worker")
        if size > 1 and args.enable_lora:
            sys.exit(f"--enable-lora with {flag} > 1: LoRA adapters are not split across a "
                     "group's ranks yet; run the adapters on one-rank workers")
    if args.tensor_parallel_size > 1 and args.pipeline_parallel_size > 1:
        sys.exit("--tensor-parallel-size and --pipeline-parallel-size together are not served "
                 "yet: set one of them to 1")
    try:
        parse_partition(args.pp_layer_partition)
    except ValueError as exc:
        sys.exit(f"--pp-layer-partition: {exc}")
    if args.tensor_parallel_timeout <= 0:
        sys.exit("--tensor-parallel-timeout must be > 0 seconds")


def group_cache_path(args, worker_id: str, advertised: str | None) -> tuple[str | None, bool]:
    """Where the KV cache lives: the shm transport's advertised file where there is one, else for
    a group a file of its own (private: unlinked once every rank mapped it); returns (path,
    private)."""
    if advertised is not None or (args.tensor_parallel_size == 1
                                  and args.pipeline_parallel_size == 1):
        return advertised, False
    # named as the shm transport's files are, so a killed group's file is found and removed
    return os.path.join(args.shm_dir, f"kvrelay-{worker_id}-{os.getpid()}.kv"), True


def group_broken(reason: str) -> None:
    """The group cannot compute any more: exit now (its followers are killed with it)."""
    log.error("rank group broken; exiting so the group restarts", reason=reason)
    os._exit(EXIT_GROUP_BROKEN)


def on_follower_death(process) -> None:
    group_broken(f"rank process {process.name} (pid {process.pid}) exited with "
                 f"{process.exitcode}")
