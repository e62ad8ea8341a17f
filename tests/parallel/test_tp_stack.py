"""Workers as tensor-parallel rank groups in a real PD stack (`kvrelay up`, float32, a random
Llama checkpoint with 4 query and 2 KV heads): a prefill group of 2 ranks pushing into one decode
worker (or into a decode group of 2) over shared memory gives the single-rank engine's greedy
tokens, the pages joined from the ranks' heads on the way out; prefix-cached pages are skipped
as before. (The reverse, one
prefill worker into a decode group of 2 over gRPC, and a decode group losing a rank to SIGKILL
and SIGSTOP under load: tests/chaos/test_tensor_parallel_faults.py, `make chaos`.)"""
from __future__ import annotations

import pytest

from tests.e2e.stack import start_stack
from tests.parallel.tp_stacks import (assert_pushed_over_shm_then_cached, followers_of,
                                      one_rank_tokens, stop_group_stack, write_tp_checkpoint)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir) -> str:
    return write_tp_checkpoint(tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[int, list[list[int]]]:
    return one_rank_tokens(checkpoint)


@pytest.mark.parametrize("decode_ranks", [1, 2])
def test_a_prefill_group_pushes_into_a_decode_worker_over_shared_memory(
        checkpoint, reference, tmp_path, decode_ranks):
    """Into one decode worker (pages joined from the prefill ranks' heads), or into a decode
    group's file (cut again by head on the way in: make test-variants)."""
    stack = start_stack("pd", tmp_path / "logs", "--model", checkpoint,
                        "--prefill-tensor-parallel-size", "2",
                        "--decode-tensor-parallel-size", str(decode_ranks))
    followers = [pid for worker in ("prefill-0", "decode-0")
                 for pid in followers_of(stack.service(worker)["pid"])]
    try:
        assert len(followers) == decode_ranks
        assert_pushed_over_shm_then_cached(stack, reference)
        workers = {w.worker_id: w for w in stack.scheduler_stats().workers}
        assert workers["prefill-0"].num_free_blocks == workers["prefill-0"].num_blocks
    finally:
        stop_group_stack(stack, followers)


