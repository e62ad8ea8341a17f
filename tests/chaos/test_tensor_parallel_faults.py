"""A decode worker that is a tensor-parallel group of 2 (fed by one prefill worker over gRPC,
the pages cut by KV head on the way in), or a pipeline of 2 stages, gives one process's greedy
tokens, then loses its other rank for real under 16 greedy streams, first to SIGKILL (seen at
once), then to SIGSTOP (seen at the step's next collective or receive, after
--tensor-parallel-timeout): no stream is lost or altered, the group is restarted whole, and its
tokens are still exact."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.chaos.load import wait_healed
from tests.e2e.stack import start_stack
from tests.parallel.tp_stacks import (LONG, SHORT, Streams, assert_parity, followers_of,
                                      one_rank_tokens, stop_group_stack, write_tp_checkpoint)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir) -> str:
    return write_tp_checkpoint(tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[int, list[list[int]]]:
    return one_rank_tokens(checkpoint, (SHORT, LONG))


@pytest.mark.parametrize("split,stopped", [
    # a rank stopped: the all-reduce's barrier gives up; a stage stopped: the leader's receive
    (("--decode-tensor-parallel-size", "2", "--kv-transport", "grpc"), "did not reach round"),
    (("--decode-pipeline-parallel-size", "2"), "Timed out waiting")])
def test_a_decode_group_loses_a_rank_to_sigkill_and_to_sigstop_and_no_stream_is_lost(
        checkpoint, reference, tmp_path, split, stopped):
    stack = start_stack("pd", tmp_path / "logs", "--model", checkpoint, *split,
                        "--tensor-parallel-timeout", "5")
    seen = []
    try:
        assert_parity(stack, reference)
        for fault in (signal.SIGKILL, signal.SIGSTOP):
            decode = stack.service("decode-0")
            restarts, [follower] = decode["restarts"], followers_of(decode["pid"])
            seen.append(follower)
            streams = Streams(stack, reference)
            time.sleep(1.0)  # the streams are decoding on the group
            os.kill(follower, fault)
            streams.check()
            wait_healed(stack, "decode-0")
            assert stack.service("decode-0")["restarts"] == restarts + 1
            assert not os.path.exists(f"/proc/{follower}")  # the stopped one killed too
        log = (tmp_path / "logs" / "up.log").read_text()
        # the death seen at once; the stopped one at the timeout, in the step it held up
        assert "exited with -9" in log and stopped in log
        assert_parity(stack, reference)
    finally:
        stop_group_stack(stack, seen + followers_of(stack.service("decode-0")["pid"]))
