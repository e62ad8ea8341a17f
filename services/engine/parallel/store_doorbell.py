"""The doorbell of a pipeline whose stages span hosts: the two counts of doorbell.py kept in the
rendezvous store (node 0's TCPStore) instead of shared memory.

A stage polls the ring count (store.add of 0: one round trip), spinning briefly, then sleeping
longer the longer it has been idle, as in shared memory. No timeout between steps while the
store answers; when the leader goes its store goes with it, and the next poll fails at once
(connection closed), or within the group's timeout where its host vanished silently.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from kvrelay.engine.parallel.step_mailbox import wait_until

RINGS_KEY, RETURNS_KEY = "kvrelay/pipeline/rings", "kvrelay/pipeline/returns"


class StoreDoorbell:
    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.answered = 0  # rings this stage has taken (a stage's own count)
        self.taken = 0  # results the leader has collected (the leader's own count)

    def ring(self) -> None:
        """Leader: one more step is coming."""
        self.store.add(RINGS_KEY, 1)

    def wait(self, leader_alive) -> None:
        """Stage: until the next step's ring (DistError once the leader's store is gone)."""
        wait_until(lambda: self.store.add(RINGS_KEY, 0) > self.answered, leader_alive)
        self.answered += 1

    def returning(self) -> None:
        """Last stage: a step's rows are on their way back."""
        self.store.add(RETURNS_KEY, 1)

    def result_ready(self) -> bool:
        """Leader: the oldest step it has not collected is on its way back."""
        return self.store.add(RETURNS_KEY, 0) > self.taken

    def take_result(self) -> None:
        self.taken += 1
