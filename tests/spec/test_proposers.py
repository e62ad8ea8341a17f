"""The proposers, the drafter's limits and the scheduler's handling of draft tokens."""
from __future__ import annotations

import pytest

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.request import Request
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.engine.spec.drafter import Drafter
from kvrelay.engine.spec.ngram import NgramProposer
from kvrelay.engine.spec.state import DraftState
from kvrelay.engine.spec.suffix import SuffixProposer
from kvrelay.engine.spec.suffix_tree import SuffixTree, likeliest_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=50)


def _request(tokens, params=GREEDY, sequence_id="r") -> Request:
    return Request(sequence_id, tokens, params)


def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4))
    # "1 2 3" occurs twice before the end; "9 1 2 3" only at the second place: that one wins
    request = _request([1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 6, 0, 9, 1, 2, 3])
    drafts, index = proposer.propose(request, None, 3)
    assert drafts == [4, 5, 6]
    request.append_token(4)  # the index grows with the sequence
    drafts, _ = proposer.propose(request, index, 2)
    assert drafts == [5, 6]
    assert proposer.propose(_request([1, 2, 3, 4]), None, 3)[0] == []  # nothing repeats


def test_suffix_tree_counts_and_removes():
    tree = SuffixTree(max_depth=3)
    tree.add([1, 2, 3, 1, 2, 4])
    node, length = tree.deepest_match([7, 1, 2])
    assert length == 2
    assert {token: child.count for token, child in node.children.items()} == {3: 1, 4: 1}
    tree.add([1, 2, 4])
    node, _ = tree.deepest_match([1, 2])
    tokens, expected = likeliest_path(node, 4, min_prob=0.1)
    assert tokens == [4] and expected == pytest.approx(2 / 3)
    tree.remove([1, 2, 4])
    tree.remove([1, 2, 3, 1, 2, 4])
    assert tree.root.children == {} and tree.num_nodes == 0


def test_incremental_tree_equals_the_whole_sequence_tree():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    grown, whole = SuffixTree(max_depth=4), SuffixTree(max_depth=4)
    for end in range(1, len(tokens) + 1):
        grown.extend(tokens[:end])
    whole.add(tokens)

    def dump(node):
        return {t: (c.count, dump(c)) for t, c in (node.children or {}).items()}

    assert dump(grown.root) == dump(whole.root) and grown.num_nodes == whole.num_nodes


def test_suffix_proposer_learns_from_finished_outputs_within_its_bound():
    config = SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=2,
                               suffix_decoding_min_token_prob=0.1)
    proposer = SuffixProposer(config)
    for index in range(3):
        finished = _request([100 + index, 8, 8])
        for token in [5, 6, 7, 8, 9]:
            finished.append_token(token)
        proposer.on_finished(finished)
    assert len(proposer._cached_outputs) == 2
    # From the global tree (nothing repeats in the request itself), as many tokens as the
    # match is long times max_spec_factor (1.0 here).
    drafts, _ = proposer.propose(_request([1, 2, 5, 6]), None, 3)
    assert drafts == [7, 8]
    drafts, _ = proposer.propose(_request([1, 2, 5, 6]), None, 1)
    assert drafts == [7]


def test_adaptive_k_follows_acceptance():
    state = DraftState(max_drafts=4)
    assert state.num_drafts == 4
    for _ in range(6):
        state.record(4, 0)
    assert state.num_drafts == 1
    for _ in range(6):
        state.record(1, 1)
    assert state.num_drafts == 2
    for _ in range(6):
        state.record(4, 4)
    assert state.num_drafts == 4


def test_drafter_limits():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                        disable_by_batch_size=8))
    repeating = [1, 2, 1, 2, 1, 2, 1, 2, 1]
    assert drafter.drafts(_request(repeating), num_running=1, room=10) == [2, 1, 2, 1]
    assert drafter.drafts(_request(repeating), num_running=8, room=10) == []  # big batch
    assert drafter.drafts(_request(repeating), num_running=1, room=2) == [2, 1]
    near_end = _request(repeating, SamplingParams(temperature=0.0, max_tokens=3))
    near_end.append_token(2)
    assert drafter.drafts(near_end, 1, 10) == [1]  # one more output, then the last token
    seeded = SamplingParams(temperature=0.7, seed=3, max_tokens=50)
    assert drafter.drafts(_request(repeating, seeded), 1, 10) == []
    opted_out = SamplingParams(temperature=0.0, max_tokens=50, disable_speculation=True)
    assert drafter.drafts(_request(repeating, opted_out), 1, 10) == []
    assert drafter.drafts(_request(repeating, SamplingParams(temperature=0.7)), 1, 10)


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle"}', "method"), ('{"method": "ngram", "k": 2}', "unknown"),
    ('{"num_speculative_tokens": 2}', "needs a method"), ("[1]", "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup"),
    ("{nope", "not valid JSON")])
def test_bad_configs_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)


def test_scheduler_computes_drafts_and_steps_back_over_rejected_ones():
    config = EngineConfig(block_size=4, max_num_batched_tokens=64)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    scheduler = Scheduler(config, num_blocks=16, max_model_len=64, drafter=drafter)
    request = _request([7, 1, 2, 3, 1, 2, 3, 1])
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": [2]})  # the prompt, then "2"
    output = scheduler.schedule()
    [item] = output.scheduled
    assert item.draft_token_ids == [3, 1, 2] and item.num_new_tokens == 4 and item.samples
    assert len(item.block_ids[0]) == 3  # slots for 9 known tokens + 3 drafts
    scheduler.update_from_output(output, {"r": [3, 9]})  # one draft accepted, then 9
    assert request.output_token_ids == [2, 3, 9]
    assert request.num_computed_tokens == request.num_tokens - 1 == 10
    assert drafter.stats.num_drafts == 1 and drafter.stats.num_accepted_tokens == 1
    assert request.draft_state.mean_accepted < 3
    scheduler.abort(["r"])
    assert scheduler.kv.num_free_blocks == 16 and request.draft_state is None
