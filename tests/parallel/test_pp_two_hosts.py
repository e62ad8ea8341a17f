"""A decode worker's pipeline across two hosts: two network namespaces, each with its own
address on a link between them (two_hosts.py). Node 0 is `kvrelay up --topology pd
--decode-pipeline-parallel-size 2 --nnodes 2 --dist-init-address HERE:PORT` (a prefill worker
and the decode pipeline's leader, stage 0); node 1 is `kvrelay worker --nnodes 2 --node-rank 1
...` in the other namespace (stage 1, the model and its settings from the leader). The prefill
worker's pages reach the leader over gRPC, and the leader sends stage 1 those of its layers
ahead of the steps that read them (staged_pages.py). The stack gives one process's greedy
tokens, serves a repeat from the prefix cache, frees every block, and keeps 16 streams exact at
once, over the link: node 1 cannot reach node 0's loopback. Node 1 answers /health for its
supervisor."""
from __future__ import annotations

import signal

import httpx
import pytest

from tests.e2e.stack import start_stack
from tests.parallel.tp_stacks import (LONG, SHORT, Streams, assert_pushed_over_shm_then_cached,
                                      followers_of, one_rank_tokens, stop_group_stack,
                                      write_tp_checkpoint)
from tests.parallel.two_hosts import rendezvous_address, start_node_one

TIMEOUT_S = "10"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir) -> str:
    return write_tp_checkpoint(tmp_path_factory, model_dir)


def test_a_decode_pipeline_across_two_hosts_gives_one_process_tokens(hosts, checkpoint,
                                                                      tmp_path):
    reference = one_rank_tokens(checkpoint, (SHORT, LONG))
    address = rendezvous_address(hosts.here)
    node_one = start_node_one(hosts, address, tmp_path / "node1.log", TIMEOUT_S)
    try:
        stack = start_stack("pd", tmp_path / "logs", "--model", checkpoint,
                            "--decode-pipeline-parallel-size", "2", "--nnodes", "2",
                            "--dist-init-address", address,
                            "--tensor-parallel-timeout", TIMEOUT_S)
        try:
            assert followers_of(stack.service("decode-0")["pid"]) == []  # stage 1: node 1
            # node 1 answers its supervisor's probe (its own metrics port, over the link)
            health = httpx.get(f"http://{hosts.there}:9110/health", timeout=10,
                               trust_env=False)
            assert health.status_code == 200
            assert_pushed_over_shm_then_cached(stack, reference, transport="grpc")
            links = hosts.connections_there()
            assert f"{hosts.there}:" in links and f"{hosts.here}:" in links, links
            workers = {w.worker_id: w for w in stack.scheduler_stats().workers}
            assert all(w.num_free_blocks == w.num_blocks for w in workers.values())
            Streams(stack, reference).check()  # micro-batches in flight across the link
            assert all(stack.service(name)["restarts"] == 0 for name in ("prefill-0",
                                                                         "decode-0"))
        finally:
            stop_group_stack(stack, [])
        assert node_one.wait(30) == 0, (tmp_path / "node1.log").read_text()  # stopped by it
    finally:
        if node_one.poll() is None:
            node_one.send_signal(signal.SIGKILL)
            node_one.wait()
