"""Waiting requests in policy order: arrival (fcfs) or priority then arrival."""
from __future__ import annotations

import heapq
import itertools

from kvrelay.engine.request import Request


class WaitingQueue:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple, int, Request]] = []
        self._members: dict[str, Request] = {}
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        # A preempted request keeps its arrival time, so it goes back to the front under fcfs.
        heapq.heappush(self._heap, (request.sort_key(self.policy), next(self._counter), request))
        self._members[request.sequence_id] = request

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[2]
        del self._members[request.sequence_id]
        return request

    def remove(self, request: Request) -> None:
        # Lazy removal: the heap entry is skipped when it reaches the top.
        if self._members.get(request.sequence_id) is request:
            del self._members[request.sequence_id]

    def __contains__(self, request: Request) -> bool:
        return self._members.get(request.sequence_id) is request

    def __iter__(self):
        """The waiting requests, in no particular order."""
        return iter(list(self._members.values()))

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] not in self:
            heapq.heappop(self._heap)
