"""The leader's steps to its followers through shared memory (engine/parallel/step_mailbox.py):
each posted value read once, in order, however long the wait; a follower whose leader is gone
stops waiting instead of waiting forever."""
from __future__ import annotations

import threading

import pytest
import torch

from kvrelay.engine.parallel.step_mailbox import StepMailbox


def test_posted_steps_arrive_in_order_and_once(tmp_path):
    path = str(tmp_path / "steps")
    leader, follower = StepMailbox(path, create=True), StepMailbox(path, create=False)
    steps = [{"tokens": torch.arange(5)}, None, "third"]
    received = []
    reader = threading.Thread(target=lambda: received.extend(
        follower.receive(lambda: True) for _ in steps))
    reader.start()
    for step in steps:
        leader.post(step)
        while follower.sequence < leader.sequence:  # the next post only once this one is read,
            pass  # as the step's own collectives guarantee between real steps
    reader.join(10)
    assert torch.equal(received[0]["tokens"], torch.arange(5)) and received[1:] == [None, "third"]


def test_a_follower_stops_waiting_when_its_leader_is_gone(tmp_path):
    path = str(tmp_path / "steps")
    StepMailbox(path, create=True)
    with pytest.raises(RuntimeError, match="leader is gone"):
        StepMailbox(path, create=False).receive(lambda: False)
