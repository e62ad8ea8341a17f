"""A speculative step of a fixed shape, timed: every sequence drafts the same number of tokens
each step, and the model steps (the runner's execute) are timed. spec_replay.py measures the
model step per query rows with it.

The drafts are the sequence's last token repeated, so most are rejected and the next step has
the same shape."""
from __future__ import annotations

import statistics
import time

from kvrelay import LLM, SamplingParams

PREFILL_STEPS = 3  # the first steps of a generation include its prefill; the median skips them


def distinct_prompt(length: int, sequence: int, round_index: int) -> list[int]:
    """Token ids distinct per sequence and round, so no prefix-cache hit shortens a prefill."""
    return [(i * 7919 + 13 * sequence + 101 * round_index) % 40000 + 100 for i in range(length)]


class ForcedDrafts:
    """Makes every sequence of `llm` draft a fixed number of tokens a step and times the model
    steps. `llm` must have been built with a speculative config whose k is at least the largest
    number of drafts asked for."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.num_drafts = 0
        self.step_seconds: list[float] = []
        engine = llm.engine
        engine.scheduler.drafter.drafts = self._drafts
        execute = engine.runner.execute_step  # what the engine core calls

        def timed(step):
            started = time.perf_counter()
            result = execute(step)
            self.step_seconds.append(time.perf_counter() - started)
            return result

        engine.runner.execute_step = timed

    def _drafts(self, request, num_running: int, room: int) -> list[int]:
        return [request.output_token_ids[-1]] * min(self.num_drafts, room)

    def time_steps(self, prompts: list[dict], params: SamplingParams, num_drafts: int) -> float:
        """The median model step in ms, past the prefill steps."""
        self.num_drafts = num_drafts
        self.step_seconds.clear()
        self.llm.generate(prompts, params, use_tqdm=False)
        return 1000 * statistics.median(self.step_seconds[PREFILL_STEPS:])
