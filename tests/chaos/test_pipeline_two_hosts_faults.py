"""A worker's pipeline across two hosts (two network namespaces, tests/parallel/two_hosts.py) loses
its second host's stage for real under 16 greedy streams, first to SIGKILL (the leader's next
receive or send fails at once: the peer closed), then to SIGSTOP (after --tensor-parallel-
timeout the leader's receive gives up, or its watcher of the host's heartbeats: heartbeats.py),
then to SIGSTOP while idle (the heartbeats alone). Each time the leader exits, `kvrelay up`
restarts it, the second host's `kvrelay worker --node-rank 1` (restarted by its own supervisor:
here, this test; a stopped one killed by it, as a liveness probe would) joins the new leader's
rendezvous, and the scheduler re-prefills the streams: none is lost or altered, and every block
is free after."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.chaos.load import wait_healed
from tests.e2e.stack import start_stack, stop_and_check
from tests.parallel.tp_stacks import (LONG, SHORT, Streams, assert_parity, one_rank_tokens,
                                      write_tp_checkpoint)
from tests.parallel.two_hosts import rendezvous_address, start_node_one

TIMEOUT_S = "5"
# (the fault, whether 16 streams are running through the pipeline when it lands)
FAULTS = ((signal.SIGKILL, True), (signal.SIGSTOP, True), (signal.SIGSTOP, False))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir) -> str:
    return write_tp_checkpoint(tmp_path_factory, model_dir)


def _wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


class NodeOneSupervisor:
    """Restarts node 1's worker whenever it exits, as Kubernetes or systemd would there."""

    def __init__(self, hosts, address: str, log_dir) -> None:
        self.hosts, self.address, self.log_dir = hosts, address, log_dir
        self.exit_codes: list[int] = []
        self.stopping = threading.Event()
        self.process = self._start()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _start(self):
        log_path = self.log_dir / f"node1-{len(self.exit_codes)}.log"
        return start_node_one(self.hosts, self.address, log_path, TIMEOUT_S)

    def _watch(self) -> None:
        while not self.stopping.is_set():
            code = self.process.wait()
            self.exit_codes.append(code)
            if not self.stopping.is_set():
                self.process = self._start()

    def stop(self) -> None:
        self.stopping.set()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.thread.join(30)


def test_the_second_hosts_stage_dies_and_stalls_and_no_stream_is_lost(hosts, checkpoint,
                                                                       tmp_path):
    reference = one_rank_tokens(checkpoint, (SHORT, LONG))
    address = rendezvous_address(hosts.here)
    node_one = NodeOneSupervisor(hosts, address, tmp_path)
    try:
        stack = start_stack("colocated", tmp_path / "logs", "--model", checkpoint,
                            "--pipeline-parallel-size", "2", "--nnodes", "2",
                            "--dist-init-address", address,
                            "--tensor-parallel-timeout", TIMEOUT_S)
        try:
            assert_parity(stack, reference)
            for count, (fault, busy) in enumerate(FAULTS, start=1):
                restarts, victim = stack.service("worker-0")["restarts"], node_one.process
                streams = Streams(stack, reference) if busy else None
                time.sleep(1.0)  # the streams are decoding through both hosts
                os.kill(victim.pid, fault)
                if fault == signal.SIGSTOP:
                    # the leader gives up on it after the timeout (inside a step, or idle: the
                    # host's heartbeats stop) and restarts; the stopped process is then its
                    # own supervisor's to kill (a liveness probe's job)
                    _wait_for(lambda: stack.service("worker-0")["restarts"] > restarts)
                    os.kill(victim.pid, signal.SIGKILL)
                if streams is not None:
                    streams.check()
                wait_healed(stack, "worker-0")
                assert stack.service("worker-0")["restarts"] == restarts + 1
                _wait_for(lambda: len(node_one.exit_codes) == count)
                assert_parity(stack, reference)
            log = (tmp_path / "logs" / "up.log").read_text()
            # the death seen by the step's receive at once; a stop by the heartbeats' watcher
            # (or a step's receive: both wait the timeout)
            assert "Connection reset by peer" in log or "Connection closed by peer" in log
            assert "sent no heartbeat" in log
        finally:
            stop_and_check(stack)
    finally:
        node_one.stop()
