"""How a pipeline's leader tells its other stages that a step is on its way, on one host.

A stage's inputs come through torch.distributed's recv, which has a timeout: right inside a
step (a stage that stalls must take the group down) but wrong between steps, when a server may
sit idle for hours. So a stage first waits here, without a timeout for as long as its leader
lives, until the leader has rung once more than the stage has answered, and only then receives.
A count, not a flag: with several steps in flight the leader rings ahead of the stages.

A second count goes the other way: the last stage bumps it as it sends a step's rows back, so
the leader can tell without blocking whether the oldest step in flight is done (it then starts
a newer step rather than wait: ModelRunner.result_ready).
"""
from __future__ import annotations

import struct

from kvrelay.engine.parallel.step_mailbox import wait_until
from kvrelay.kernels.shm_collectives import map_shared_file

COUNT = struct.Struct("<q")
RINGS, RETURNS = 0, COUNT.size  # the two counts' offsets


class Doorbell:
    def __init__(self, path: str, create: bool) -> None:
        self.map = map_shared_file(path, 2 * COUNT.size, create)
        self.answered = 0  # rings this stage has taken (a stage's own count)
        self.taken = 0  # results the leader has collected (the leader's own count)

    def ring(self) -> None:
        """Leader: one more step is coming (one writer: a plain increment)."""
        self._bump(RINGS)

    def wait(self, leader_alive) -> None:
        """Stage: until the next step's ring."""
        wait_until(lambda: COUNT.unpack_from(self.map, RINGS)[0] > self.answered, leader_alive)
        self.answered += 1

    def returning(self) -> None:
        """Last stage: a step's rows are on their way back (one writer)."""
        self._bump(RETURNS)

    def result_ready(self) -> bool:
        """Leader: the oldest step it has not collected is on its way back."""
        return COUNT.unpack_from(self.map, RETURNS)[0] > self.taken

    def take_result(self) -> None:
        self.taken += 1

    def _bump(self, offset: int) -> None:
        (count,) = COUNT.unpack_from(self.map, offset)
        COUNT.pack_into(self.map, offset, count + 1)
