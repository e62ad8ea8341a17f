"""Recovery is exact: a sample whose worker died (or whose KV transfer failed) goes on with the
very tokens an uninterrupted run gives, seeded random sampling and penalties included, on real
workers (the cluster driver with the default model's StepExecutors, model_cluster.py).

A recovered sample keeps its prompt, with its tokens so far as outputs, and is prefilled again
over all of them: penalties still count them, min_tokens and max_tokens too, the worker skips
one draw of the seeded generator per output, and the grammar matcher, which has taken them all,
is not fed them again.

Each run submits the same mix of requests, so one run checks them all: "r", seeded random with
every penalty and n=2 (each sample its own stream), "s" the same with n=1 and another seed, "g"
greedy with penalties, "k" greedy on a prompt that repeats itself (what speculative decoding
drafts for), and "j" seeded random under a grammar (the grammar ends it)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from kvrelay.engine.llm import eos_token_ids
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.engine.structured.compiler import make_backend
from kvrelay.engine.structured.spec import StructuredOutputs
from kvrelay.scheduler.messages import BOTH, DECODE, PREFILL
from kvrelay.scheduler.records import Phase
from tests.services.cluster_driver import BLOCK_SIZE, LENGTH, STOP
from tests.services.model_cluster import ModelClusterDriver, model_worker_info

MAX_TOKENS = 8
# EOS banned throughout (min_tokens): each of these runs MAX_TOKENS long, and only the sampling
# decides its tokens.
SEEDED = dict(temperature=1.0, seed=1234, frequency_penalty=0.6, presence_penalty=0.4,
              repetition_penalty=1.3, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=2)
GREEDY = dict(temperature=0.0, frequency_penalty=0.6, repetition_penalty=1.3,
              max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
ANIMALS = StructuredOutputs("regex", "(cat|dog|bird|fish)( (cat|dog|bird|fish)){5}")
CONSTRAINED = dict(temperature=1.0, seed=7, presence_penalty=0.5, max_tokens=30,
                   structured_outputs=ANIMALS)
SAMPLES = [("r", 0), ("r", 1), ("s", 0), ("g", 0), ("k", 0), ("j", 0)]


@pytest.fixture(scope="module")
def model(model_dir, tokenizer):
    hf_config = AutoConfig.from_pretrained(model_dir)
    # A one-block cache of its own: each worker a driver registers gets its own cache.
    runner = ModelRunner(hf_config, model_dir, torch.float32, torch.device("cpu"), BLOCK_SIZE,
                         1, 0)
    eos = tuple(sorted(eos_token_ids(hf_config, model_dir, tokenizer)))
    grammar = make_backend("llguidance", model_dir / "tokenizer.json", hf_config.vocab_size,
                           list(eos)).compile(ANIMALS)
    prompts = {"story": tokenizer("The old lighthouse keeper climbed the stairs every night, "
                                  "and on the last night of the year he")["input_ids"],
               "animals": tokenizer("Name some animals:")["input_ids"],
               "counting": tokenizer("one two three four five, one two three four five, one "
                                     "two three")["input_ids"]}
    assert BLOCK_SIZE < len(prompts["story"]) < 2 * BLOCK_SIZE
    return runner, hf_config.vocab_size, eos, prompts, grammar


def _driver(model, topology: str, **config) -> ModelClusterDriver:
    runner, vocab_size, eos, _, _ = model
    roles = {"pd": [("p0", PREFILL), ("d0", DECODE)], "colocated": [("c0", BOTH)]}[topology]
    return ModelClusterDriver(runner, [model_worker_info(runner, worker_id, role, 32,
                                                         vocab_size, eos)
                                       for worker_id, role in roles], **config)


def _submit_mix(driver, model) -> None:
    prompts, grammar = model[3], model[4]
    driver.submit("r", prompts["story"], **SEEDED, n=2)
    driver.submit("s", prompts["story"], **dict(SEEDED, seed=99))
    driver.submit("g", prompts["story"], **GREEDY)
    driver.submit("k", prompts["counting"], temperature=0.0, max_tokens=MAX_TOKENS)
    driver.submit("j", prompts["animals"], grammar=grammar, **CONSTRAINED)


def _replace(driver, worker_id: str) -> None:
    """The worker is declared dead (its step and its sends never answer), and a fresh process
    (an empty sequence table, a zeroed KV cache) registers under its id."""
    old = driver.worker(worker_id).info
    driver.kill(worker_id)
    driver.register(model_worker_info(driver.runner, worker_id, old.role, old.num_blocks,
                                      old.vocab_size, old.eos_token_ids))


def _live_samples(driver):
    return [s for s in driver.cluster.samples.values() if not s.done]


def _first_tokens_out(driver) -> None:
    """PD: the prefill step sampled the first tokens; their pages are still in flight."""
    while not driver.sends:
        assert driver.step("p0")


def _decoding(driver, num_tokens: int) -> None:
    """PD: the samples decode on d0 until each has num_tokens tokens."""
    _first_tokens_out(driver)
    driver.deliver_sends()
    while min(s.request.num_output_tokens for s in _live_samples(driver)) < num_tokens:
        assert driver.step("d0")


# ---- what happens before the requests run to their end -------------------------------------------
def _killed_mid_decode(driver):
    _decoding(driver, 4)
    _replace(driver, "d0")
    for sample in _live_samples(driver):  # the original request, outputs and all
        assert sample.phase is Phase.PREFILL and sample.retries == 1
        request, submitted = sample.request, driver.requests[sample.parent.request_id]
        assert request.prompt_token_ids == submitted.prompt
        assert request.output_token_ids == driver.tokens(sample.parent.request_id, sample.index)
        assert request.params is sample.parent.params  # max_tokens, min_tokens as submitted
    driver.step("p0")  # prefilled again, the prompt's first block a prefix hit on p0
    for sample in _live_samples(driver):
        if sample.parent.num_prompt_tokens > BLOCK_SIZE:
            assert sample.request.num_cached_prompt_tokens >= BLOCK_SIZE
        clone = sample.transfer.decode_request  # the pages go with the earlier outputs
        assert clone.prompt_token_ids == sample.request.prompt_token_ids
        assert clone.output_token_ids == sample.request.output_token_ids[:-1]


def _decode_side_lost_mid_handoff(driver):
    _first_tokens_out(driver)
    _replace(driver, "d0")


def _prefill_side_lost_mid_handoff(driver):
    _first_tokens_out(driver)
    _replace(driver, "p0")  # mid-send: its decode blocks are set aside till the deadline


def _prefill_side_lost_in_its_last_chunk(driver):
    assert driver.start_step("p0") and driver.sends  # no token out yet
    _replace(driver, "p0")


def _failed_transfers_after_a_recovery(driver):
    _decoding(driver, 3)
    _replace(driver, "d0")
    _first_tokens_out(driver)  # prefilled again over prompt and outputs, the pages sent
    # (those relying on another's push of a shared prefix first: the push's failure would end
    # them, their own pages still in flight)
    for transfer_id in reversed(list(driver.sends)):
        driver.send_result(transfer_id, ok=False)
    assert all(s.retries == 2 for s in _live_samples(driver))


PD_EVENTS = {
    "killed-mid-decode": _killed_mid_decode,
    "decode-lost-mid-handoff": _decode_side_lost_mid_handoff,
    "prefill-lost-mid-handoff": _prefill_side_lost_mid_handoff,
    "prefill-lost-in-its-last-chunk": _prefill_side_lost_in_its_last_chunk,
    "failed-transfers-after-a-recovery": _failed_transfers_after_a_recovery,
}


def _colocated_killed_mid_decode(driver):
    for _ in range(4):
        assert driver.step("c0")
    _replace(driver, "c0")


# ---- running and comparing --------------------------------------------------------------------
def _run(model, topology: str, events=None, **config) -> ModelClusterDriver:
    """The mix from submission to its end, everything checked."""
    driver = _driver(model, topology, **config)
    _submit_mix(driver, model)
    if events is not None:
        events(driver)
        assert driver.cluster.num_recoveries >= len(SAMPLES)
    driver.run()
    driver.check_deltas(ended=True)
    driver.check_accounting()
    driver.assert_quiescent()  # every block free on every worker, the dead ones' too
    return driver


def _outputs(driver) -> dict:
    """Per sample: its tokens, how it ended, its logprobs, and the usage its client counts
    (completion tokens, cached prompt tokens)."""
    outputs = {}
    for request_id, index in SAMPLES:
        deltas = driver.requests[request_id].deltas[index]
        tokens = driver.tokens(request_id, index)
        outputs[request_id, index] = (
            tokens, driver.final(request_id, index).finish_reason,
            [(e.token_id, e.rank, tuple(t.token_id for t in e.top), e.logprob)
             for d in deltas for e in d.logprobs],
            len(tokens), sum(d.num_cached_prompt_tokens for d in deltas))
    return outputs


def _assert_same(got: dict, expected: dict) -> None:
    for key, (tokens, reason, logprobs, num_tokens, num_cached) in got.items():
        want_tokens, want_reason, want_logprobs, want_num, want_cached = expected[key]
        assert tokens == want_tokens, key
        assert (reason, num_tokens, num_cached) == (want_reason, want_num, want_cached), key
        assert [entry[:3] for entry in logprobs] == [entry[:3] for entry in want_logprobs]
        # (after a recovery a token's logits come from a prefill: the same up to rounding)
        assert all(math.isclose(a[3], b[3], abs_tol=1e-3)
                   for a, b in zip(logprobs, want_logprobs)), key


@pytest.fixture(scope="module")
def uninterrupted(model):
    """The mix, run without a failure, per topology."""
    cache = {}

    def get(topology: str) -> dict:
        if topology not in cache:
            cache[topology] = _outputs(_run(model, topology))
        return cache[topology]
    return get


def test_the_uninterrupted_mix_is_what_the_tests_need(uninterrupted):
    outputs = uninterrupted("pd")
    for key in [("r", 0), ("r", 1), ("s", 0), ("g", 0), ("k", 0)]:
        assert outputs[key][1] == LENGTH and outputs[key][3] == MAX_TOKENS
    assert len({tuple(outputs[key][0]) for key in [("r", 0), ("r", 1), ("s", 0)]}) == 3
    assert outputs["j", 0][1] == STOP and outputs["j", 0][3] > 5  # the grammar ended it


@pytest.mark.parametrize("event", PD_EVENTS)
def test_pd_recovered_samples_give_the_uninterrupted_tokens(model, uninterrupted, event):
    _assert_same(_outputs(_run(model, "pd", PD_EVENTS[event])), uninterrupted("pd"))


def test_pd_recovered_under_speculative_decoding_gives_the_uninterrupted_tokens(
        model, uninterrupted):
    """The drafter drafts for the greedy sample over its whole sequence, outputs from before
    the recovery included (seeded samples are never speculated)."""
    # its six sequences speculate from the start (the batch switch is not under test here)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=0)
    driver = _run(model, "pd", _killed_mid_decode, speculative_config=spec)
    _assert_same(_outputs(driver), uninterrupted("pd"))
    stats = driver.cluster.registry.drafter.stats
    assert stats.num_accepted_tokens > 0, stats


def test_colocated_recovered_samples_give_the_uninterrupted_tokens(model, uninterrupted):
    _assert_same(_outputs(_run(model, "colocated", _colocated_killed_mid_decode)),
                 uninterrupted("colocated"))
