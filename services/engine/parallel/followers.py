"""The ranks of a tensor-parallel group after the first: processes of their own, each holding
its shard of the model and its KV heads, running every step the leader runs.

The leader (rank 0: the engine's own ModelRunner) broadcasts each step's inputs; every rank
computes the same step on its shard, the row-parallel layers summing their partial outputs
(group.py), and the leader samples from the gathered logits. A follower whose leader goes away
fails its next collective within the group's timeout and exits: nothing is left hanging.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket

import torch

from kvrelay.engine.parallel.group import init_group, leave_group

log = logging.getLogger(__name__)
STOP = None  # what the leader broadcasts to end the followers' loops


def free_init_method(host: str = "127.0.0.1") -> str:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def threads_per_rank(size: int, requested: int | None) -> int:
    """Each rank its share of the cores (ranks on one host must not share them)."""
    return requested or max(1, (os.cpu_count() or 1) // size)


def start_followers(size: int, init_method: str, runner_args: tuple, runner_kwargs: dict,
                    num_threads: int) -> list[multiprocessing.Process]:
    """Ranks 1..size-1, each building ModelRunner(*runner_args, **runner_kwargs, tp=its
    group) and then following the leader's steps."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, size):
        process = context.Process(target=follow, name=f"tp-rank-{rank}", daemon=True,
                                  args=(rank, size, init_method, runner_args, runner_kwargs,
                                        num_threads))
        process.start()
        processes.append(process)
    return processes


def follow(rank: int, size: int, init_method: str, runner_args: tuple, runner_kwargs: dict,
           num_threads: int) -> None:
    from kvrelay.engine.model_runner import ModelRunner
    torch.set_num_threads(num_threads)
    device = runner_args[3]
    group = init_group(rank, size, init_method, device)
    try:
        runner = ModelRunner(*runner_args, **runner_kwargs, tp=group)
        while (step := group.broadcast_object(None)) is not STOP:
            runner.execute_step(step)
    finally:
        leave_group()


def stop_followers(group, processes: list[multiprocessing.Process]) -> None:
    """Tell the followers to leave (called by the leader), then reap them."""
    if group.size > 1:
        try:
            group.broadcast_object(STOP)
        except RuntimeError:  # a follower already gone: the others time out and exit
            pass
        leave_group()
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
