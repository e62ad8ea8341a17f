"""How a pipeline's leader tells its other stages that a step is on its way, on one host.

A stage's inputs come through torch.distributed's recv, which has a timeout: right inside a
step (a stage that stalls must take the group down) but wrong between steps, when a server may
sit idle for hours. So a stage first waits here, without a timeout for as long as its leader
lives, until the leader has rung once more than the stage has answered, and only then receives.
A count, not a flag: with several steps in flight the leader rings ahead of the stages.
"""
from __future__ import annotations

import struct

from kvrelay.engine.parallel.step_mailbox import wait_until
from kvrelay.kernels.shm_collectives import map_shared_file

COUNT = struct.Struct("<q")


class Doorbell:
    def __init__(self, path: str, create: bool) -> None:
        self.map = map_shared_file(path, COUNT.size, create)
        self.answered = 0  # rings this stage has taken (a stage's own count)

    def ring(self) -> None:
        """Leader: one more step is coming (one writer: a plain increment)."""
        (count,) = COUNT.unpack_from(self.map, 0)
        COUNT.pack_into(self.map, 0, count + 1)

    def wait(self, leader_alive) -> None:
        """Stage: until the next step's ring."""
        wait_until(lambda: COUNT.unpack_from(self.map, 0)[0] > self.answered, leader_alive)
        self.answered += 1
