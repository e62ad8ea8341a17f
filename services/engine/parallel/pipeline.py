"""A pipeline-parallel group as its stages see it: this process's stage, the layers it runs,
and the messages that carry a step from stage to stage on torch.distributed (gloo on CPU).

Stage 0, the leader, embeds the step's tokens, runs its layers and sends the step with its
activations (the residual stream, and the last layer's output where the layers' adds are fused
into the norms) to stage 1, which runs its layers and sends on; the last stage sends the rows
the leader samples (and scores or pools) back to it, and the leader applies the final norm and
the head. Each message waits at most the group's timeout (a stage that dies or stalls takes the
group down instead of hanging it); between steps a stage waits on the doorbell (doorbell.py;
store_doorbell.py where the stages span hosts), which has none.

A group of one is the default everywhere: the model runs whole in this process.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvrelay.engine.parallel.doorbell import Doorbell
from kvrelay.engine.parallel.group import (DEFAULT_TIMEOUT_S, GroupBroken, join_process_group,
                                           map_group_files)
from kvrelay.engine.parallel.nodes import NodePlacement
from kvrelay.engine.parallel.store_doorbell import StoreDoorbell

STOP = None  # the step a leaving leader sends down the pipeline


@dataclass(frozen=True)
class PipelineStage:
    stage: int = 0
    num_stages: int = 1
    layers: range | None = None  # the layers this stage runs (None: every layer)
    doorbell: Doorbell | StoreDoorbell | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    every_stage_layers: tuple[range, ...] = ()  # each stage's layers, this one's among them
    hosts: int = 1  # the stages run on this many hosts, as many a host

    @property
    def size(self) -> int:
        return self.num_stages

    @property
    def is_leader(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def stages_per_host(self) -> int:
        return self.num_stages // self.hosts

    def least(self, value: int) -> int:
        """The least of every stage's `value` (at setup)."""
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        return int(box)

    @property
    def next_stage(self) -> int:
        """Where this stage's output goes: the next stage, or from the last, the leader."""
        return (self.stage + 1) % self.num_stages

    @property
    def previous_stage(self) -> int:
        return (self.stage - 1) % self.num_stages

    def broadcast_object(self, value=None):
        """The leader's `value` on every stage (at setup)."""
        if self.num_stages == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def post_step(self, step) -> None:
        """Leader: only STOP goes this way (each stage passes it on, then leaves); steps go
        through the first stage's layers (ModelRunner.start_step)."""
        assert step is STOP
        self.doorbell.ring()
        self.send(pack_header(STOP, []), [])

    def send(self, header: bytes, tensors: list[torch.Tensor]) -> None:
        """To the next stage: a pickled header (pack_header) and its tensors, waiting until
        the stage has taken them."""
        self.wait_sent(self.start_send(header, tensors))

    def start_send(self, header: bytes, tensors: list[torch.Tensor]) -> Sending:
        """send without waiting: the leader's, whose sends a stage takes only after it has sent
        back an earlier step's rows, which the leader receives after this (gloo completes a
        send when the peer receives it: waiting here would deadlock with two steps in flight)."""
        payload = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        buffers = [torch.tensor([payload.numel()], dtype=torch.int64), payload,
                   *(tensor.contiguous() for tensor in tensors)]
        return Sending(buffers, [self._started(dist.isend, buffer, self.next_stage)
                                 for buffer in buffers])

    def wait_sent(self, sending: Sending) -> None:
        for work in sending.works:
            self._wait(work)

    def receive(self) -> tuple[bytes, object, list[torch.Tensor]]:
        """From the previous stage: (the header's bytes, its value, its tensors)."""
        size = torch.empty(1, dtype=torch.int64)
        self._wait(dist.irecv(size, self.previous_stage))
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._wait(dist.irecv(payload, self.previous_stage))
        header = payload.numpy().tobytes()
        value, specs = pickle.loads(header)
        tensors = []
        for shape, dtype in specs:
            tensor = torch.empty(shape, dtype=dtype)
            self._wait(dist.irecv(tensor, self.previous_stage))
            tensors.append(tensor)
        return header, value, tensors

    @staticmethod
    def _started(operation, *args):
        try:
            return operation(*args)
        except RuntimeError as exc:  # gloo: the peer is gone
            raise GroupBroken(str(exc)) from exc

    def _wait(self, work) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo: a stage closed, or the timeout passed
            raise GroupBroken(str(exc)) from exc


@dataclass(slots=True)
class Sending:
    """A message on its way: its buffers (kept alive until sent) and their sends."""
    buffers: list[torch.Tensor]
    works: list


def pack_header(value, tensors: list[torch.Tensor]) -> bytes:
    """A message's header: `value` and its tensors' shapes and dtypes."""
    specs = [(tuple(tensor.shape), tensor.dtype) for tensor in tensors]
    return pickle.dumps((value, specs), protocol=pickle.HIGHEST_PROTOCOL)


def init_pipeline(stage: int, num_stages: int, init_method: str,
                  timeout_s: float = DEFAULT_TIMEOUT_S,
                  placement: NodePlacement = NodePlacement(), setup: tuple | None = None):
    """Join the group's rendezvous (a TCPStore at init_method) as `stage` (CPU). The leader
    passes setup = (every stage's layers, *what else its stages need) and every stage gets it
    back: returns (this stage, setup)."""
    placement.choose_gloo_interface()
    join_process_group(stage, num_stages, init_method, torch.device("cpu"), timeout_s)
    box = [setup]
    dist.broadcast_object_list(box, src=0)
    setup = box[0]
    if placement.multi_host:
        doorbell = StoreDoorbell(*placement.host_port(), timeout_s)
    else:
        doorbell = map_group_files(stage, lambda stem, create: Doorbell(stem + ".bell", create),
                                   (".bell",))
    return PipelineStage(stage, num_stages, setup[0][stage], doorbell, timeout_s,
                         tuple(setup[0]), placement.nnodes), setup
