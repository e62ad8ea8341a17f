"""Drive the in-process engine step by step on an arrival schedule, timing every step.

The records it fills are the same as `bench serve`'s, with each engine step that gave a request
tokens standing for one streamed chunk, so the same metrics and tables apply to both.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvrelay.bench.records import RequestRecord

_run_ids = itertools.count()  # request ids stay unique when one engine serves several runs


@dataclass(slots=True)
class OfflineItem:
    token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    tag: str = ""


@dataclass(slots=True)
class EngineRun:
    records: list[RequestRecord]
    duration_s: float
    step_seconds: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)  # from the start of the run


def drive(llm, items: list[OfflineItem], temperature: float = 0.0, ignore_eos: bool = True,
          time_limit_s: float | None = None) -> EngineRun:
    from kvrelay.engine import SamplingParams
    engine, run_id = llm.engine, next(_run_ids)
    pending = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    records: dict[int, RequestRecord] = {}
    live: dict[str, RequestRecord] = {}
    result = EngineRun([], 0.0)
    start = time.perf_counter()
    while pending or engine.has_unfinished:
        now = time.perf_counter() - start
        if time_limit_s is not None and now > time_limit_s:
            _abort(engine, live)
            break
        while pending and items[pending[0]].arrival_s <= now:
            index = pending.pop(0)
            item = items[index]
            params = SamplingParams(temperature=temperature, max_tokens=item.max_tokens,
                                    ignore_eos=ignore_eos)
            request = llm._make_requests(f"bench-{run_id}-{index}", item.token_ids, params,
                                         0)[0]
            records[index] = live[request.sequence_id] = RequestRecord(
                index, item.tag, sent_s=now, prompt_tokens=len(item.token_ids),
                usage_reported=True)
            engine.add_request(request)
        if not engine.has_unfinished:
            time.sleep(max(0.0, items[pending[0]].arrival_s - now))  # idle until the next one
            continue
        _step(engine, live, result, start)
    result.records = [records[i] for i in sorted(records)]
    finished = [r.sent_s + r.done_s for r in result.records if r.done_s is not None]
    result.duration_s = (time_limit_s if live and time_limit_s is not None
                         else max(finished, default=0.0))
    return result


def _step(engine, live: dict[str, RequestRecord], result: EngineRun, start: float) -> None:
    began = time.perf_counter()
    updates = engine.step()
    ended = time.perf_counter()
    result.step_seconds.append(ended - began)
    result.step_end_s.append(ended - start)
    for update in updates:
        record = live.get(update.request.sequence_id)
        if record is None:
            continue
        if update.new_token_ids:
            record.token_times_s.append(ended - start - record.sent_s)
            record.output_tokens += len(update.new_token_ids)
        if update.finished:
            record.done_s = ended - start - record.sent_s
            del live[update.request.sequence_id]


def _abort(engine, live: dict[str, RequestRecord]) -> None:
    engine.abort(list(live))
    for record in live.values():
        record.error = "cancelled at the time limit"
