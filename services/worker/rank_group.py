"""A worker as a rank group: a tensor-parallel group on one host (`--tensor-parallel-size N`) or a
pipeline (`--pipeline-parallel-size N`), on one host or across several (`--nnodes`: each host's
`kvrelay worker --node-rank K` runs its stages; node 0's is the leader, below). This process is
rank 0 (stage 0), the leader, and starts ranks 1..N-1 (engine/parallel/followers.py). The
scheduler sees one worker: the leader registers, steps, samples and moves KV pages for all; the
group's KV cache lives in one shared file which the leader maps whole: a tensor-parallel rank's
heads in a region of its own (engine/parallel/group_kv.py), a stage's layers in their slots
(engine/parallel/stage_kv.py).

The group lives and dies as one. A follower that dies, or a rank that stalls in a step past
--tensor-parallel-timeout, leaves the group unable to compute: the leader exits at once with
EXIT_GROUP_BROKEN (its followers die with it), its requests are recovered by the scheduler as
for any lost worker (re-prefilled elsewhere), and the supervisor (`kvrelay up`, Kubernetes)
restarts the whole group. A pipeline across hosts has no shared file: each stage holds its own
layers' pages; pushed pages reach the leader over gRPC, which sends the other stages theirs."""
from __future__ import annotations

import os
import sys

from kvrelay.common.log import get_logger
from kvrelay.engine.parallel.nodes import NodePlacement
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
    if args.enable_expert_parallel and args.tensor_parallel_size == 1:
        sys.exit("--enable-expert-parallel splits experts across the ranks of "
                 "--tensor-parallel-size > 1")
    if args.tensor_parallel_size > 1 and args.pipeline_parallel_size > 1:
        sys.exit("--tensor-parallel-size and --pipeline-parallel-size together are not served "
                 "yet: set one of them to 1")
    try:
        parse_partition(args.pp_layer_partition)
    except ValueError as exc:
        sys.exit(f"--pp-layer-partition: {exc}")
    try:
        placement(args).check(args.pipeline_parallel_size, args.tensor_parallel_size)
    except ValueError as exc:
        sys.exit(str(exc))
    if args.nnodes > 1 and "grpc" not in args.kv_transports.split(","):
        sys.exit("--nnodes > 1 takes KV pushes over gRPC only (its stages share no file): "
                 "--kv-transports must include grpc")
    if args.nnodes > 1 and args.role == "prefill":
        sys.exit("--nnodes > 1 with --role prefill: a pipeline across hosts decodes (--role "
                 "decode or both); its other hosts' pages cannot be read for a push yet")
    if args.tensor_parallel_timeout <= 0:
        sys.exit("--tensor-parallel-timeout must be > 0 seconds")


def placement(args) -> NodePlacement:
    """The hosts this worker's pipeline spans, from its flags."""
    return NodePlacement(args.nnodes, args.node_rank, args.dist_init_address)


def group_cache_path(args, worker_id: str, advertised: str | None) -> tuple[str | None, bool]:
    """Where the KV cache lives: the shm transport's advertised file where there is one, else for
    a group a file of its own (private: unlinked once every rank mapped it); returns (path,
    private)."""
    if args.nnodes > 1:  # each stage holds its own layers' pages (staged_pages.py)
        return None, False
    if advertised is not None or (args.tensor_parallel_size == 1
                                  and args.pipeline_parallel_size == 1):
        return advertised, False
    # named as the shm transport's files are, so a killed group's file is found and removed
    return os.path.join(args.shm_dir, f"kvrelay-{worker_id}-{os.getpid()}.kv"), True


def group_broken(reason: str) -> None:
    """The group cannot compute any more: exit now (its followers are killed with it)."""
    log.error("rank group broken; exiting so the group restarts", reason=reason)
    os._exit(EXIT_GROUP_BROKEN)


def watch_group(args, followers: list) -> list:
    """Watch this worker's group: its processes on this host, and (a pipeline across hosts)
    the other hosts' heartbeats; returns the events that stop the watching."""
    from kvrelay.engine.parallel.followers import watch_followers
    from kvrelay.engine.parallel.heartbeats import watch_beats
    watching = [watch_followers(followers, on_follower_death)]
    if args.nnodes > 1:
        watching.append(watch_beats(*placement(args).host_port(), range(1, args.nnodes),
                                    args.tensor_parallel_timeout, on_silent_node))
    return watching


def on_silent_node(node_rank: int) -> None:
    group_broken(f"node {node_rank}'s pipeline stages sent no heartbeat for "
                 "--tensor-parallel-timeout")


def on_follower_death(process) -> None:
    group_broken(f"rank process {process.name} (pid {process.pid}) exited with "
                 f"{process.exitcode}")
