"""Long-prompt chunk sizes: the attention crossover from a model config, and chunks that shrink
as the context grows so each one costs about the same."""
from __future__ import annotations

from types import SimpleNamespace

from kvrelay.engine.prefill_chunks import attention_crossover, long_prefill_chunk
from tests.test_scheduler import _request, _scheduler


def test_crossover_of_smollm2_135m_and_llama_3_8b():
    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              head_dim=64, intermediate_size=1536)
    llama3 = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=None, intermediate_size=14336)
    assert attention_crossover(smollm2) == 3072
    assert attention_crossover(llama3) == 26624


def test_chunks_shrink_as_the_context_grows_and_cost_the_same():
    crossover = 3072
    sizes = [long_prefill_chunk(384, context, crossover) for context in (0, 1000, 2000, 3000)]
    assert sizes[0] == 384 and sizes == sorted(sizes, reverse=True)
    for context, size in zip((0, 1000, 2000, 3000), sizes):
        # weight matmuls ~ size, attention ~ size * context / crossover
        assert abs(size * (1 + context / crossover) - 384) <= 1
    assert long_prefill_chunk(384, 5000, 0) == 384  # unknown model: one size
    assert long_prefill_chunk(4, 10**9, 3072) == 1  # always some progress


def test_the_scheduler_cuts_a_long_prompt_into_shrinking_chunks_while_decoding():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=512,
                           long_prefill_token_threshold=64)
    scheduler.attention_crossover = 64
    scheduler.add_request(_request("short", 3, max_tokens=100))
    scheduler.update_from_output(scheduler.schedule(), {"short": [3]})
    long_request = _request("long", 120, max_tokens=1)
    scheduler.add_request(long_request)
    chunks = []
    while long_request.num_output_tokens == 0:
        output = scheduler.schedule()
        chunks += [i.num_new_tokens for i in output.scheduled if i.request is long_request]
        scheduler.update_from_output(output, {i.request.sequence_id: [3] for i in output.scheduled
                                              if i.samples})
    assert sum(chunks) == 120
    assert chunks == [64, 32, 24]  # 64 * 64 / (64 + context): 64, 32, 25 (24 left)
