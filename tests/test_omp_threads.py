"""run_torch_ops_inline: the calling thread's torch ops stop using OpenMP, nobody else's do."""
import os

import pytest
import torch

from kvrelay.engine.omp_threads import run_torch_ops_inline
from tests.threads import on_a_thread


def _num_process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here anyway")
def test_an_inline_thread_runs_big_ops_without_starting_openmp_threads():
    main_threads = torch.get_num_threads()
    source = torch.randn(8, 2, 300, 16, 64)
    index = torch.randperm(300)[:200]

    def copy_pages():
        assert run_torch_ops_inline()
        before = _num_process_threads()
        pages = source.index_select(2, index)
        target = torch.zeros_like(source)
        target.index_copy_(2, index, pages)
        # Counted while this thread still lives: a pool's threads would be alive now too.
        return torch.get_num_threads(), _num_process_threads() - before, pages, target

    inline_threads, new_threads, pages, target = on_a_thread(copy_pages)
    assert inline_threads == 1
    assert new_threads == 0
    assert torch.equal(pages, source[:, :, index])
    assert torch.equal(target[:, :, index], source[:, :, index])
    assert torch.get_num_threads() == main_threads  # other threads keep their count
