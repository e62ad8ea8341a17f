"""How long a worker's idle OpenMP threads spin before they sleep, set before torch loads.

After a parallel region, libgomp's worker threads spin waiting for the next one: 300,000 turns
by default, about 5 ms of a core here (measured: CPU burned in a 100 ms sleep after a matmul).
Inside a forward pass that is what keeps the hundreds of back-to-back regions fast. After a
step it is a core taken from everything that runs between steps: the step result going to the
scheduler, the scheduler's planning, the gateway's streaming, and on one machine the other
worker's next step, whose own OpenMP threads then stall at their barriers.

100,000 turns (about 1.7 ms) still bridge the gaps inside a step with room to spare: 10,000 did
not (the 64-sequence decode step was 1.5-1.9x slower, its threads sleeping between regions),
30,000 did. On a PD stack (benchmarks/stack.py, BENCHMARKS.md) 100,000 beat both 30,000 and the
default in every round. libgomp reads the variable once, when torch loads it, so a value set by
the user wins and a process that already imported torch is unaffected.
"""
from __future__ import annotations

import os

SPIN_COUNT = "100000"


def limit_openmp_spinning() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
