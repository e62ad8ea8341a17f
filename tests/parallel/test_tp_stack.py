"""Workers as tensor-parallel rank groups in a real PD stack (`kvrelay up`, float32, a random
Llama checkpoint with 4 query and 2 KV heads): a prefill group of 2 ranks pushing into one
decode worker over shared memory, and one prefill worker pushing into a decode group of 2 over
gRPC, the pages resharded by KV head on the way, give the single-rank engine's greedy tokens;
prefix-cached pages are skipped as before. A decode group loses a rank for real, SIGKILL and
SIGSTOP, under 16 greedy streams: no stream is lost or altered, the group is restarted whole,
every block is free afterwards."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvrelay.engine import LLM, SamplingParams
from tests.chaos.load import wait_healed
from tests.e2e.grpc_api import generate, token_ids_request
from tests.e2e.stack import start_stack, stop_and_check
from tests.families.checkpoints import write_checkpoint

PROMPTS = [[1, 5, 9, 200, 3000, 17] * 7, [1, 42, 7] * 20, [1] + list(range(100, 230, 3))]
SHORT, LONG = 24, 320
NUM_STREAMS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir) -> str:
    folder = tmp_path_factory.mktemp("llama3-tp")
    write_checkpoint("llama3", folder, model_dir)
    return str(folder)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[int, list[list[int]]]:
    """One rank's greedy tokens, offline: {max_tokens: per prompt}."""
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=256)
    return {count: [list(output.outputs[0].token_ids) for output in llm.generate(
        [{"prompt_token_ids": prompt} for prompt in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True), use_tqdm=False)]
        for count in (SHORT, LONG)}


def _tokens(stack, prompt: list[int], max_tokens: int):
    return generate(stack.grpc_address, token_ids_request(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True), timeout_s=300)


def _assert_parity(stack, reference) -> None:
    for prompt, expected in zip(PROMPTS, reference[SHORT]):
        assert _tokens(stack, prompt, SHORT).token_ids[0] == expected


def _followers(worker_pid: int) -> list[int]:
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


def _stop(stack, followers: list[int]) -> None:
    stop_and_check(stack)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in followers):
        assert time.monotonic() < deadline, "a rank outlived its stack"
        time.sleep(0.2)


def test_a_prefill_group_pushes_into_one_decode_worker_over_shared_memory(
        checkpoint, reference, tmp_path):
    stack = start_stack("pd", tmp_path / "logs", "--model", checkpoint,
                        "--prefill-tensor-parallel-size", "2")
    followers = _followers(stack.service("prefill-0")["pid"])
    try:
        assert len(followers) == 1
        _assert_parity(stack, reference)
        again = _tokens(stack, PROMPTS[0], SHORT)  # its full blocks now come from the cache
        assert again.token_ids[0] == reference[SHORT][0]
        assert again.usage.cached_prompt_tokens >= 32
        workers = {w.worker_id: w for w in stack.scheduler_stats().workers}
        assert workers["prefill-0"].num_free_blocks == workers["prefill-0"].num_blocks
    finally:
        _stop(stack, followers)


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
            tokens = _tokens(stack, prompt, LONG).token_ids[0]
            expected = reference[LONG][index % len(PROMPTS)]
            self.results[index] = "exact" if tokens == expected else f"differs: {tokens}"
        except Exception as exc:  # noqa: BLE001 - reported below
            self.results[index] = repr(exc)

    def check(self) -> None:
        for thread in self.threads:
            thread.join(300)
        assert self.results == {index: "exact" for index in range(NUM_STREAMS)}


def test_a_decode_group_loses_a_rank_to_sigkill_and_to_sigstop_and_no_stream_is_lost(
        checkpoint, reference, tmp_path):
    stack = start_stack("pd", tmp_path / "logs", "--model", checkpoint,
                        "--decode-tensor-parallel-size", "2", "--kv-transport", "grpc",
                        "--tensor-parallel-timeout", "5")
    seen = []
    try:
        _assert_parity(stack, reference)
        for fault in (signal.SIGKILL, signal.SIGSTOP):
            decode = stack.service("decode-0")
            restarts, [follower] = decode["restarts"], _followers(decode["pid"])
            seen.append(follower)
            streams = Streams(stack, reference)
            time.sleep(1.0)  # the streams are decoding on the group
            os.kill(follower, fault)
            streams.check()
            wait_healed(stack, "decode-0")
            assert stack.service("decode-0")["restarts"] == restarts + 1
            assert not os.path.exists(f"/proc/{follower}")  # the stopped one killed too
        log = (tmp_path / "logs" / "up.log").read_text()
        # the death seen at once; the stopped rank at the timeout, in the step it held up
        assert "exited with -9" in log and "did not reach round" in log
        _assert_parity(stack, reference)
    finally:
        _stop(stack, seen + _followers(stack.service("decode-0")["pid"]))
