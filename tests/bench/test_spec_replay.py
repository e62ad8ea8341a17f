"""benchmarks/spec_replay.py replays greedy outputs through the scheduler's own Drafter."""
from benchmarks.spec_replay import parse_step_ms, replay
from kvrelay.engine.spec.config import SpeculativeConfig

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                          prompt_lookup_max=5)
PASSAGE = list(range(100, 160))


def test_an_output_copied_from_its_prompt_is_drafted_and_accepted():
    # The output repeats the prompt's passage: after two tokens every draft is the truth.
    samples = [{"prompt": PASSAGE + [7, 8], "output": PASSAGE[:40]}]
    result = replay(samples, NGRAM, max_tokens=64, step_cost=None)
    assert result.emitted == 39  # every output token past the prefill step's
    assert result.drafting_steps > 0
    assert result.emitted / result.steps > 3  # most steps emit 4 drafts + 1


def test_an_output_with_nothing_to_copy_takes_a_step_a_token():
    samples = [{"prompt": [1, 2, 3], "output": list(range(500, 530))}]
    result = replay(samples, NGRAM, max_tokens=64, step_cost={1: 1.0, 5: 2.0})
    assert (result.steps, result.drafting_steps, result.emitted) == (29, 0, 29)
    assert result.report()["predicted_speedup"] == 1.0


def test_rejected_drafts_cost_their_rows():
    # The prompt's passage continues differently from the output: drafts are made and refused.
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    samples = [{"prompt": prompt, "output": [9, 1, 2, 40, 41, 42, 43]}]
    cost = {rows: 1.0 + 0.5 * (rows - 1) for rows in range(1, 6)}
    result = replay(samples, NGRAM, max_tokens=64, step_cost=cost)
    assert result.rows > result.steps
    assert result.report()["predicted_speedup"] < 1.0


def test_step_costs_are_read_as_rows_and_ms():
    assert parse_step_ms("1:6.0, 2:7.5") == {1: 6.0, 2: 7.5}
