"""The worker's rank-group flags: what cannot make a group stops the worker at start with the
reason; where the group's KV cache file lives."""
from __future__ import annotations

import argparse

import pytest

from kvrelay.worker.flags import add_arguments
from kvrelay.worker.rank_group import check_group_flags, group_cache_path


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,reason", [
    (["-tp", "0"], "must be >= 1"),
    (["--tensor-parallel-size", "2", "--device", "cuda"], "runs on CPU"),
    (["--tensor-parallel-size", "2", "--enable-lora"], "LoRA adapters are not split"),
    (["--tensor-parallel-timeout", "0"], "must be > 0"),
    (["--enable-expert-parallel"], "splits experts across the ranks"),
    # a pipeline across hosts
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "-pp", "2"], "--node-rank must be in 0..1"),
    (["--nnodes", "2", "-pp", "3", "--dist-init-address", "10.0.0.1:29500"],
     "must be a multiple of --nnodes 2"),
    (["--nnodes", "2", "-pp", "2"], "needs --dist-init-address"),
    (["--nnodes", "2", "-pp", "2", "--dist-init-address", "10.0.0.1"], "must be HOST:PORT"),
    (["--nnodes", "2", "-tp", "2", "--dist-init-address", "10.0.0.1:1"],
     "tensor-parallel group stays on one host"),
    (["--nnodes", "2", "-pp", "2", "--dist-init-address", "10.0.0.1:1", "--role", "prefill"],
     "a pipeline across hosts decodes"),
    (["--nnodes", "2", "-pp", "2", "--dist-init-address", "10.0.0.1:1", "--kv-transports",
      "shm"], "must include grpc"),
])
def test_what_cannot_make_a_group_stops_the_worker_with_the_reason(argv, reason):
    with pytest.raises(SystemExit, match=reason):
        check_group_flags(_args(*argv))


def test_one_rank_and_a_group_pass():
    check_group_flags(_args())
    check_group_flags(_args("-tp", "4", "--enable-lora", "--tensor-parallel-size", "1"))
    check_group_flags(_args("--tensor-parallel-size", "2", "--tensor-parallel-timeout", "5"))
    check_group_flags(_args("--nnodes", "2", "--node-rank", "1", "-pp", "4",
                            "--dist-init-address", "[fd00::1]:29500"))


def test_the_group_cache_file():
    """A decode worker's shm file serves the group; a prefill group gets one of its own, named
    like it (a killed group's file is found and removed at the next start)."""
    args = _args("--tensor-parallel-size", "2", "--shm-dir", "/dev/shm")
    assert group_cache_path(args, "decode-0", "/dev/shm/advertised.kv") == (
        "/dev/shm/advertised.kv", False)
    path, private = group_cache_path(args, "prefill-0", None)
    assert private and path.startswith("/dev/shm/kvrelay-prefill-0-") and path.endswith(".kv")
    assert group_cache_path(_args(), "prefill-0", None) == (None, False)


def test_a_pipeline_across_hosts_keeps_no_shared_cache_file():
    """Its stages' pages live on their hosts: nothing for a KV connector to map."""
    args = _args("--nnodes", "2", "-pp", "2", "--dist-init-address", "10.0.0.1:29500")
    assert group_cache_path(args, "worker-0", None) == (None, False)
