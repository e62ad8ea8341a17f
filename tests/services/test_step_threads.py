"""StepThreads: a step's thread count reaches torch on the compute thread, and only there."""
import torch

from kvrelay.worker.step_threads import StepThreads
from tests.threads import on_a_thread


def test_a_step_runs_on_the_threads_it_asks_for_and_never_on_more_than_the_worker_has():
    main_threads = torch.get_num_threads()

    def compute_thread():
        torch.set_num_threads(2)  # the worker's own count, as load_worker_model sets it
        threads = StepThreads(2)
        seen = []
        for requested in (1, 0, 1, 1, 8, 0):
            threads.use(requested)
            torch.ones(64, 64) @ torch.ones(64, 64)  # a parallel op in between
            seen.append(torch.get_num_threads())
        return seen

    assert on_a_thread(compute_thread) == [1, 2, 1, 1, 2, 2]
    assert torch.get_num_threads() == main_threads  # other threads keep their count
