"""Each step's inputs from a group's leader to its other ranks on one host, through shared
memory.

gloo's broadcast has a timeout, which is right for a collective inside a step but wrong for the
wait between steps: a server can sit idle for hours, and a follower waiting in a broadcast would
time out and take the group down. Here the leader writes the pickled step into a shared buffer
and then bumps a sequence number; a follower polls the number, briefly spinning and then
sleeping longer the longer it has been idle (at most MAX_SLEEP_S), for as long as its leader
lives. The buffer is not overwritten while a follower still reads it: the leader writes step
n + 1 only after step n's collectives, which every rank reaches only after reading step n.
A step larger than the buffer goes through gloo (rare: a prefill of tens of thousands of
tokens).
"""
from __future__ import annotations

import pickle
import struct
import time

import torch.distributed as dist

from kvrelay.kernels.shm_collectives import map_shared_file

HEADER = struct.Struct("<qq")  # sequence number, payload bytes (-1: the payload went by gloo)
BUFFER_BYTES = 32 << 20
SPIN_S = 50e-6
MAX_SLEEP_S = 2e-3


class StepMailbox:
    def __init__(self, path: str, create: bool, buffer_bytes: int = BUFFER_BYTES) -> None:
        self.map = map_shared_file(path, HEADER.size + buffer_bytes, create)
        self.capacity = buffer_bytes
        self.sequence = 0  # the last step posted (leader) or read (follower)

    def post(self, value) -> None:
        """Leader: hand `value` to every follower."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        self.sequence += 1
        if len(payload) > self.capacity:
            self.map[:HEADER.size] = HEADER.pack(self.sequence, -1)
            dist.broadcast_object_list([value], src=0)
            return
        self.map[HEADER.size:HEADER.size + len(payload)] = payload
        # the number last: a follower that sees it finds the whole payload before it
        self.map[:HEADER.size] = HEADER.pack(self.sequence, len(payload))

    def receive(self, leader_alive) -> object:
        """Follower: wait for the next posted value (as long as `leader_alive()` holds)."""
        wait_until(lambda: HEADER.unpack_from(self.map, 0)[0] > self.sequence, leader_alive)
        sequence, size = HEADER.unpack_from(self.map, 0)
        self.sequence = sequence
        if size < 0:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return pickle.loads(self.map[HEADER.size:HEADER.size + size])


def wait_until(ready, leader_alive, idle_sleep_s: float = MAX_SLEEP_S) -> None:
    """Poll `ready()` with no timeout while the leader lives: spinning briefly, then sleeping
    longer the longer the group has been idle (at most MAX_SLEEP_S, and after a second idle at
    most idle_sleep_s: a poll that costs a network round trip backs off further)."""
    waited, sleep = 0.0, SPIN_S
    while not ready():
        if waited > 1.0 and not leader_alive():
            raise RuntimeError("the group's leader is gone")
        time.sleep(sleep)
        waited += sleep
        most = idle_sleep_s if waited > 1.0 else MAX_SLEEP_S
        sleep = min(most, sleep * 2) if waited > 0.01 else SPIN_S
