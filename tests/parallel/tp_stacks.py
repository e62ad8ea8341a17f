"""What the tensor-parallel stack tests share: a random Llama checkpoint with 4 query and 2 KV
heads, one rank's greedy tokens for it offline, a stack's tokens over gRPC, and the worker's
rank processes."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvrelay.engine import LLM, SamplingParams
from tests.e2e.grpc_api import generate, token_ids_request
from tests.e2e.stack import metric_values, stop_and_check
from tests.families.checkpoints import write_checkpoint

PROMPTS = [[1, 5, 9, 200, 3000, 17] * 7, [1, 42, 7] * 20, [1] + list(range(100, 230, 3))]
SHORT = 24  # tokens of each parity check


def write_tp_checkpoint(tmp_path_factory, model_dir) -> str:
    folder = tmp_path_factory.mktemp("llama3-tp")
    write_checkpoint("llama3", folder, model_dir)
    return str(folder)


def one_rank_tokens(checkpoint: str, counts=(SHORT,)) -> dict[int, list[list[int]]]:
    """One rank's greedy tokens, offline: {max_tokens: per prompt}."""
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=256)
    return {count: [list(output.outputs[0].token_ids) for output in llm.generate(
        [{"prompt_token_ids": prompt} for prompt in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True), use_tqdm=False)]
        for count in counts}


def tokens_of(stack, prompt: list[int], max_tokens: int):
    return generate(stack.grpc_address, token_ids_request(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True), timeout_s=300)


def assert_parity(stack, reference) -> None:
    for prompt, expected in zip(PROMPTS, reference[SHORT]):
        assert tokens_of(stack, prompt, SHORT).token_ids[0] == expected


def assert_pushed_over_shm_then_cached(stack, reference, transport: str = "shm") -> None:
    """Parity, the prefill worker's pages gone over `transport` only, and a repeated prompt's
    full blocks served from the prefix cache."""
    assert_parity(stack, reference)
    pushed = metric_values(stack.service("prefill-0")["metrics_url"],
                           "kvrelay:kv_transfer_bytes_total")
    assert pushed.get(f'{{transport="{transport}"}}', 0) > 0 and len(pushed) == 1, pushed
    again = tokens_of(stack, PROMPTS[0], SHORT)
    assert again.token_ids[0] == reference[SHORT][0]
    assert again.usage.cached_prompt_tokens >= 32


def followers_of(worker_pid: int) -> list[int]:
    """The worker's rank processes (started from its compute thread, so scanned by parent)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == worker_pid and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


def stop_group_stack(stack, followers: list[int]) -> None:
    stop_and_check(stack)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in followers):
        assert time.monotonic() < deadline, "a rank outlived its stack"
        time.sleep(0.2)


LONG = 320  # tokens a stream decodes: the fault lands while they run
NUM_STREAMS = 16


class Streams:
    """NUM_STREAMS greedy requests at once over gRPC, each checked against one rank's tokens."""

    def __init__(self, stack, reference) -> None:
        self.results: dict[int, object] = {}
        self.threads = [threading.Thread(target=self._run, args=(stack, reference, index))
                        for index in range(NUM_STREAMS)]
        for thread in self.threads:
            thread.start()

    def _run(self, stack, reference, index: int) -> None:
        prompt = PROMPTS[index % len(PROMPTS)]
        try:
            tokens = tokens_of(stack, prompt, LONG).token_ids[0]
            expected = reference[LONG][index % len(PROMPTS)]
            self.results[index] = "exact" if tokens == expected else f"differs: {tokens}"
        except Exception as exc:  # noqa: BLE001 - reported below
            self.results[index] = repr(exc)

    def check(self) -> None:
        for thread in self.threads:
            thread.join(300)
        assert self.results == {index: "exact" for index in range(NUM_STREAMS)}
