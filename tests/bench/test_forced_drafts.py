"""benchmarks/forced_drafts.py gives every decode step the shape asked for: one token and the
forced drafts per sequence (what spec_replay --measure-rows times)."""
from benchmarks.forced_drafts import PREFILL_STEPS, ForcedDrafts, distinct_prompt
from kvrelay import LLM, SamplingParams


def test_every_decode_step_carries_the_forced_drafts():
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "disable_by_batch_size": 0})
    forced = ForcedDrafts(llm)
    rows_per_step: list[int] = []
    timed = llm.engine.runner.execute_step

    def recording(step):
        rows_per_step.append(step.max_seqlen_q)
        return timed(step)

    llm.engine.runner.execute_step = recording
    prompt = {"prompt_token_ids": distinct_prompt(40, sequence=0, round_index=0)}
    step_ms = forced.time_steps([prompt], SamplingParams(temperature=0.0, max_tokens=25,
                                                         ignore_eos=True), num_drafts=3)
    assert step_ms > 0
    assert len(forced.step_seconds) == len(rows_per_step) > PREFILL_STEPS
    assert set(rows_per_step[PREFILL_STEPS:-1]) == {4}  # the last step may lack room for drafts


def test_prompts_differ_by_sequence_and_round():
    prompts = {tuple(distinct_prompt(16, seq, rnd)) for seq in range(3) for rnd in range(3)}
    assert len(prompts) == 9
