"""Workers as pipelines in a real PD stack (`kvrelay up`, float32, a random Llama checkpoint):
a prefill pipeline of 2 stages pushing over shared memory into a decode pipeline of 2 stages
gives the single-process engine's greedy tokens, one request at a time and 16 at once (steps of
two micro-batches in flight on each pipeline). Each group's KV cache is one file its leader
maps whole, the stages writing their own layers' slots: the pages go out and come in whole, as
between single workers, and prefix-cached pages are skipped as before."""
from __future__ import annotations

import pytest

from tests.e2e.stack import start_stack
from tests.parallel.tp_stacks import (LONG, SHORT, Streams, assert_pushed_over_shm_then_cached,
                                      followers_of, one_rank_tokens, stop_group_stack,
                                      write_tp_checkpoint)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir) -> str:
    return write_tp_checkpoint(tmp_path_factory, model_dir)


def test_a_prefill_pipeline_pushes_into_a_decode_pipeline(checkpoint, tmp_path):
    reference = one_rank_tokens(checkpoint, (SHORT, LONG))
    stack = start_stack("pd", tmp_path / "logs", "--model", checkpoint,
                        "--pipeline-parallel-size", "2", "--tensor-parallel-timeout", "10")
    followers = [pid for worker in ("prefill-0", "decode-0")
                 for pid in followers_of(stack.service(worker)["pid"])]
    try:
        assert len(followers) == 2  # one more stage each
        assert_pushed_over_shm_then_cached(stack, reference)
        workers = {w.worker_id: w for w in stack.scheduler_stats().workers}
        for name in ("prefill-0", "decode-0"):
            assert workers[name].num_free_blocks == workers[name].num_blocks
        # 16 streams at once: two micro-batches in flight on each pipeline, every text exact
        # and no worker restarted (a stage blocked in a send would time the group out)
        Streams(stack, reference).check()
        assert all(stack.service(name)["restarts"] == 0 for name in ("prefill-0", "decode-0"))
    finally:
        stop_group_stack(stack, followers)
