"""The compute thread's thread count, step by step: the scheduler may ask a step to run on fewer
threads than the worker has, when workers on the same cores step side by side
(`--shared-compute-steps split`). Only the compute thread runs torch's parallel work
(omp_threads.py), so setting its count here sets the whole worker's."""
from __future__ import annotations

import torch


class StepThreads:
    def __init__(self, own: int) -> None:
        self.own = own  # the worker's threads (--num-threads, or torch's default)
        self.current = own

    def use(self, requested: int) -> None:
        """Call on the compute thread before a step; 0 asks for all of the worker's threads."""
        wanted = min(requested, self.own) if requested else self.own
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
