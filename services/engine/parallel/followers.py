"""The ranks of a tensor-parallel group after the first: processes of their own, each holding
its shard of the model and its KV heads, running every step the leader runs.

The leader (rank 0: the engine's or the worker's own ModelRunner) posts each step's inputs;
every rank computes the same step on its shard, the row-parallel layers summing their partial
outputs (group.py), and the leader samples from the gathered logits. The group lives and dies
as one: a follower is killed with its leader (the kernel's parent-death signal), and the leader
learns at once of a follower's death (watch_followers) or, for a rank that stalls, within the
group's timeout in its next collective.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading

import torch

from kvrelay.engine.models.registry import arch_spec
from kvrelay.engine.parallel.group import (DEFAULT_TIMEOUT_S, TPGroup, init_group,
                                           leave_group)
from kvrelay.engine.parallel.heartbeats import start_beating
from kvrelay.engine.parallel.nodes import NodePlacement
from kvrelay.engine.parallel.partition import parse_partition, stage_layers
from kvrelay.engine.parallel.pipeline import PipelineStage, init_pipeline
from kvrelay.engine.parallel.shard import check_shardable
from kvrelay.engine.parallel.staged_pages import KvWrites

log = logging.getLogger(__name__)
STOP = None  # what the leader posts to end the followers' loops
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def threads_per_rank(size: int, requested: int | None) -> int:
    """Each rank its share of the cores (ranks on one host must not share them)."""
    return requested or max(1, (os.cpu_count() or 1) // size)


def start_ranks(config, runner_args: tuple, runner_kwargs: dict,
                timeout_s: float = DEFAULT_TIMEOUT_S, placement: NodePlacement = NodePlacement()):
    """The processes of an engine's model: a tensor-parallel group, a pipeline (its stages on
    this host, where `placement` spreads it over several), or this process alone (config:
    EngineConfig, or a worker's flags of the same names). Returns (this rank's TPGroup, its
    PipelineStage, the other ranks' processes on this host)."""
    if config.pipeline_parallel_size > 1:
        pp, followers = start_pipeline(config.pipeline_parallel_size,
                                       parse_partition(config.pp_layer_partition),
                                       config.num_threads, runner_args, runner_kwargs,
                                       timeout_s, placement, config.model)
        return TPGroup(), pp, followers
    tp, followers = start_group(config.tensor_parallel_size, config.num_threads, runner_args,
                                runner_kwargs, timeout_s)
    return tp, PipelineStage(), followers


def start_group(size: int, num_threads: int | None, runner_args: tuple, runner_kwargs: dict,
                timeout_s: float = DEFAULT_TIMEOUT_S):
    """This process as rank 0 of a tensor-parallel group of `size`, ranks 1..size-1 started
    (processes of their own, each building ModelRunner(*runner_args, **runner_kwargs, tp=its
    rank)), or a group of one; returns (the group, the followers' processes)."""
    if size == 1:
        return TPGroup(), []
    check_shardable(arch_spec(runner_args[0])[1], size,  # before any rank starts
                    runner_kwargs.get("expert_parallel", False))
    threads = threads_per_rank(size, num_threads)
    torch.set_num_threads(threads)
    init_method = NodePlacement().init_method()  # a free local port
    followers = _spawn(follow, "tp-rank", range(1, size), lambda rank: (
        rank, size, init_method, runner_args, runner_kwargs, threads, timeout_s))
    try:
        return init_group(0, size, init_method, runner_args[3], timeout_s), followers
    except BaseException:
        _reap(followers, wait_s=0)
        raise


def start_pipeline(num_stages: int, partition: tuple[int, ...] | None, num_threads: int | None,
                   runner_args: tuple, runner_kwargs: dict,
                   timeout_s: float = DEFAULT_TIMEOUT_S,
                   placement: NodePlacement = NodePlacement(), model: str | None = None):
    """This process as stage 0 of a pipeline of `num_stages` (the other stages of this host
    started as processes, those of other hosts joining from there: serve_stages; each builds
    ModelRunner(*runner_args, **runner_kwargs, pp=its stage), another host with `model`, the
    checkpoint as the user named it, found there), or a pipeline of one; returns (the stage,
    this host's other stages' processes)."""
    layers = stage_layers(arch_spec(runner_args[0])[1], num_stages, partition)
    if num_stages == 1:
        return PipelineStage(layers=layers[0]), []
    if runner_args[3].type != "cpu":
        raise ValueError("pipeline parallelism runs on CPU for now; on CUDA use tensor "
                         "parallelism")
    here = placement.stages_here(num_stages)
    threads = threads_per_rank(len(here), num_threads)
    torch.set_num_threads(threads)
    log.info("pipeline stages' layers: %s", ", ".join(
        f"{stage}: {part.start}-{part.stop - 1}" for stage, part in enumerate(layers)))
    init_method = placement.init_method()
    followers = _spawn(follow_stage, "pp-stage", here[1:], lambda stage: (
        stage, num_stages, init_method, threads, timeout_s, placement))
    try:
        pp, _ = init_pipeline(0, num_stages, init_method, timeout_s, placement,
                              (layers, runner_args, runner_kwargs, model))
        return pp, followers
    except BaseException:
        _reap(followers, wait_s=0)
        raise


def serve_stages(placement: NodePlacement, num_stages: int, num_threads: int | None,
                 timeout_s: float, on_ready=lambda: None, model_here: str | None = None) -> None:
    """A host other than node 0: its stages of the leader's pipeline (the model and its
    settings come from the leader; model_here: where this host keeps the checkpoint, if not
    where the leader's --model names it), until the leader stops them (returns) or is gone
    (GroupBroken or DistError); on_ready() once this host's first stage has its layers."""
    here = placement.stages_here(num_stages)
    threads = threads_per_rank(len(here), num_threads)
    init_method = placement.init_method()
    others = _spawn(follow_stage, "pp-stage", here[1:], lambda stage: (
        stage, num_stages, init_method, threads, timeout_s, placement, True, None, model_here))
    try:
        follow_stage(here.start, num_stages, init_method, threads, timeout_s, placement,
                     spawned=False, on_ready=on_ready, model_here=model_here)
    finally:
        _reap(others, wait_s=30)


def follow_stage(stage: int, num_stages: int, init_method: str, num_threads: int,
                 timeout_s: float, placement: NodePlacement, spawned: bool = True,
                 on_ready=None, model_here: str | None = None) -> None:
    """A later stage's life: each step's activations in, this stage's layers, on to the next.
    spawned: a process its host's first stage started (it dies with it); else that first
    stage itself, on a host other than the leader's."""
    from kvrelay.engine.model_runner import ModelRunner
    alive = _parent_alive() if spawned else (lambda: True)  # else: the store tells
    torch.set_num_threads(num_threads)
    pp, (_, runner_args, runner_kwargs, model) = init_pipeline(stage, num_stages, init_method,
                                                                timeout_s, placement)
    beating = None
    if not spawned:  # the leader's watcher hears from this host (heartbeats.py)
        beating = start_beating(*placement.host_port(), placement.node_rank, timeout_s)
    try:
        if placement.multi_host and runner_args[1] is not None:
            runner_args = checkpoint_here(runner_args, model_here or model)
        runner = ModelRunner(*runner_args, **runner_kwargs, pp=pp)
        if on_ready is not None:
            on_ready()
        while True:
            pp.doorbell.wait(alive)
            header, step, tensors = pp.receive()
            if step is STOP:
                if not pp.is_last:
                    pp.send(header, [])
                return
            if isinstance(step, KvWrites):  # pages the connector wrote, ahead of a step
                runner.write_staged_pages(step, tensors)
                continue
            runner.run_stage(step, header, tensors)
    finally:
        if beating is not None:
            beating.set()
        leave_group()


def checkpoint_here(runner_args: tuple, model: str | None) -> tuple:
    """The leader's ModelRunner arguments with the checkpoint found on this host (`model`: the
    leader's --model, or this host's own path to it); ValueError where that holds another
    model than the leader's."""
    from transformers import AutoConfig

    from kvrelay.engine.model_loader import resolve_model_dir
    model_dir = resolve_model_dir(model)
    ignored = ("_name_or_path", "transformers_version")
    here, leaders = (
        {key: value for key, value in config.to_dict().items() if key not in ignored}
        for config in (AutoConfig.from_pretrained(model_dir), runner_args[0]))
    if here != leaders:
        raise ValueError(f"the checkpoint at {model_dir} on this host is not the leader's "
                         f"(its config.json differs)")
    return (runner_args[0], model_dir, *runner_args[2:])


def follow(rank: int, size: int, init_method: str, runner_args: tuple, runner_kwargs: dict,
           num_threads: int, timeout_s: float) -> None:
    from kvrelay.engine.model_runner import ModelRunner
    alive = _parent_alive()
    torch.set_num_threads(num_threads)
    device = runner_args[3]
    group = init_group(rank, size, init_method, device, timeout_s)
    try:
        runner = ModelRunner(*runner_args, **runner_kwargs, tp=group)
        while (step := group.next_step(alive)) is not STOP:
            runner.execute_step(step)
    finally:
        leave_group()


def _spawn(target, name: str, ranks: range, args_of) -> list[multiprocessing.Process]:
    """These ranks as processes (spawn: a fresh interpreter, no forked torch state)."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in ranks:
        process = context.Process(target=target, name=f"{name}-{rank}", daemon=True,
                                  args=args_of(rank))
        process.start()
        processes.append(process)
    return processes


def _parent_alive():
    """For a process the leader (or its host's first stage) started: dies with it, and a
    check that it still lives (a reparented process's leader is gone)."""
    parent = os.getppid()
    _die_with_parent()
    return lambda: os.getppid() == parent


def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it dies (Linux): a follower never
    outlives its leader, even one killed with SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the mailbox's liveness check still holds
        pass


def watch_followers(processes: list[multiprocessing.Process], on_death) -> threading.Event:
    """Call on_death(process) from a daemon thread as soon as a follower exits; set the
    returned event first to stop watching (a deliberate stop)."""
    stopping = threading.Event()
    if not processes:
        return stopping

    def watch() -> None:
        from multiprocessing.connection import wait
        ready = wait([process.sentinel for process in processes])
        if not stopping.is_set():
            gone = next(process for process in processes if process.sentinel in ready)
            gone.join(timeout=1)  # reaped: its exit code known
            on_death(gone)
    threading.Thread(target=watch, name="tp-watch", daemon=True).start()
    return stopping


def stop_followers(group, processes: list[multiprocessing.Process]) -> None:
    """Tell the followers to leave (called by the leader), then reap them."""
    if group.size > 1:
        try:
            group.post_step(STOP)
        except RuntimeError:  # a follower already gone: the others time out and exit
            pass
        leave_group()
    _reap(processes, wait_s=30)


def _reap(processes: list[multiprocessing.Process], wait_s: float) -> None:
    for process in processes:
        process.join(timeout=wait_s)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
