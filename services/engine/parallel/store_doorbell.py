"""The doorbell of a pipeline whose stages span hosts: the two counts of doorbell.py kept in the
rendezvous store (node 0's TCPStore) instead of shared memory.

A stage polls the ring count (store.add of 0: one round trip), spinning briefly, then sleeping
longer the longer it has been idle, as in shared memory, and after a second idle at most
IDLE_POLL_S apart (each poll crosses the network). No timeout between steps while the store
answers; when the leader goes its store goes with it, and the next poll fails at once
(connection closed), or within the group's timeout where its host vanished silently. Each
thread has a store client of its own (the worker's event loop asks result_ready while its
compute thread rings).
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from kvrelay.engine.parallel.step_mailbox import wait_until

RINGS_KEY, RETURNS_KEY = "kvrelay/pipeline/rings", "kvrelay/pipeline/returns"
IDLE_POLL_S = 0.02


class StoreDoorbell:
    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.address = (host, port, timedelta(seconds=timeout_s))
        self.clients = threading.local()
        self.answered = 0  # rings this stage has taken (a stage's own count)
        self.taken = 0  # results the leader has collected (the leader's own count)
        self._store()  # connected now: a store that cannot be reached fails the start

    def _store(self) -> dist.TCPStore:
        client = getattr(self.clients, "store", None)
        if client is None:
            host, port, timeout = self.address
            client = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
            self.clients.store = client
        return client

    def ring(self) -> None:
        """Leader: one more step is coming."""
        self._store().add(RINGS_KEY, 1)

    def wait(self, leader_alive) -> None:
        """Stage: until the next step's ring (DistError once the leader's store is gone)."""
        store = self._store()
        wait_until(lambda: store.add(RINGS_KEY, 0) > self.answered, leader_alive, IDLE_POLL_S)
        self.answered += 1

    def returning(self) -> None:
        """Last stage: a step's rows are on their way back."""
        self._store().add(RETURNS_KEY, 1)

    def result_ready(self) -> bool:
        """Leader: the oldest step it has not collected is on its way back."""
        return self._store().add(RETURNS_KEY, 0) > self.taken

    def take_result(self) -> None:
        self.taken += 1
