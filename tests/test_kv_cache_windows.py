"""A hybrid KV cache without a model: window groups keep a bounded ring of blocks while the
request runs, the freed blocks go back to the pool (and stay cached), and prefix hits need what
every group reads."""
from __future__ import annotations

from kvrelay.engine.block_pool import KVBlock, hash_block
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.kv_groups import KVGroupLayout
from kvrelay.engine.prefix_hits import longest_prefix
from kvrelay.engine.request import Request
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import Scheduler

BLOCK_SIZE = 4
WINDOW = 16
# Gemma 3's pattern on 12 layers: 1 global : 5 local -> 5 window groups and 1 full one
LAYOUT = KVGroupLayout.from_windows(([WINDOW] * 5 + [0]) * 2)


def _request(sequence_id: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(sequence_id, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       ignore_eos=True))


def _scheduler(num_blocks: int, **overrides) -> Scheduler:
    config = EngineConfig(block_size=BLOCK_SIZE, **overrides)
    return Scheduler(config, num_blocks=num_blocks, max_model_len=1024,
                     group_windows=LAYOUT.windows)


def _run_to_the_end(scheduler: Scheduler, check=lambda: None) -> None:
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        sampled = {item.request.sequence_id: [3] for item in output.scheduled if item.samples}
        scheduler.update_from_output(output, sampled)
        check()


def test_a_long_request_holds_its_full_blocks_and_one_window_per_window_group():
    scheduler = _scheduler(num_blocks=400, max_num_batched_tokens=32)
    request = _request("long", list(range(100, 300)), max_tokens=60)  # 200 prompt tokens
    scheduler.add_request(request)
    num_window_groups = sum(1 for window in LAYOUT.windows if window)
    ring = -(-WINDOW // BLOCK_SIZE) + 1
    most = 0

    def check():
        if request.is_finished:
            return
        held = scheduler.kv.num_held_blocks("long")
        assert held <= -(-request.num_tokens // BLOCK_SIZE) + ring * num_window_groups
        nonlocal most
        most = max(most, held)

    _run_to_the_end(scheduler, check)
    assert request.num_output_tokens == 60
    length = 259  # the last token computed: 200 + 59
    assert most >= -(-length // BLOCK_SIZE) + (ring - 1) * num_window_groups
    # a full-attention cache would hold 6 groups' worth: 6 * 65 blocks
    assert most < 2 * -(-length // BLOCK_SIZE)
    assert scheduler.kv.num_window_freed > 0
    assert scheduler.kv.num_free_blocks == 400  # every block back once it ends


def test_freed_blocks_go_back_to_the_pool_while_the_request_runs():
    scheduler = _scheduler(num_blocks=200, max_num_batched_tokens=16)
    request = _request("r", list(range(64)), max_tokens=4)
    scheduler.add_request(request)
    free_after = []
    while request.num_computed_tokens < 64:
        output = scheduler.schedule()
        scheduler.update_from_output(output, {"r": [3]} if output.scheduled[0].samples else {})
        free_after.append(scheduler.kv.num_free_blocks)
    # 16-token chunks: each step adds 4 blocks per group (24) and, once past the window, the
    # 5 window groups free the 4 they no longer reach (20)
    assert [a - b for a, b in zip(free_after, free_after[1:])] == [4, 4, 4]
    assert scheduler.kv.num_window_freed == 5 * (64 - WINDOW) // BLOCK_SIZE
    freed = [block for block in scheduler.kv.pool.blocks
             if block.ref_cnt == 0 and block.block_hash is not None]
    assert len(freed) == scheduler.kv.num_window_freed  # evictable, still cached


def test_a_prefix_hit_spans_every_group_after_the_window_freed_its_start():
    scheduler = _scheduler(num_blocks=200, max_num_batched_tokens=64)
    prompt = list(range(500, 548))  # 48 tokens: 12 blocks
    first = _request("first", prompt, max_tokens=2)
    scheduler.add_request(first)
    _run_to_the_end(scheduler)
    second = _request("second", prompt + [7, 8], max_tokens=2)
    hit = scheduler.kv.get_computed_blocks(second)
    assert hit.num_blocks == 12
    for window, blocks in zip(LAYOUT.windows, hit.blocks):
        in_window = [block for block in blocks if block is not None]
        # a window group needs only the blocks its window reaches from token 48
        assert len(in_window) == (12 if not window else WINDOW // BLOCK_SIZE)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert second.num_cached_prompt_tokens == 48 and output.scheduled[0].num_new_tokens == 2
    # the groups' tables never share a block
    tables = scheduler.kv.block_ids("second")
    held = [block.block_id for block in scheduler.kv.held_blocks("second")]
    assert len(held) == len(set(held)) and len(tables) == LAYOUT.num_groups


def _finder(cached: dict[int, set[int]]):
    """A prefix cache holding, per group, the listed block indices."""
    blocks: dict[tuple[int, int], KVBlock] = {}

    def find(block_hash, group):
        index = block_hash.token_ids[0]
        if index not in cached[group]:
            return None
        return blocks.setdefault((group, index), KVBlock(len(blocks)))
    return find


def test_the_hit_search_cuts_to_a_prefix_every_group_can_use():
    hashes, parent = [], None
    for index in range(10):
        parent = hash_block(parent, [index] * BLOCK_SIZE)
        hashes.append(parent)
    windows = (0, 8)  # a window of two blocks
    # window group lost blocks 3-5 and 8: the longest usable prefix is 8 blocks
    hit = longest_prefix(hashes, windows, BLOCK_SIZE,
                         _finder({0: set(range(10)), 1: {0, 1, 2, 6, 7, 9}}))
    assert hit.num_blocks == 8
    assert [block is not None for block in hit.blocks[1]] == [False] * 6 + [True] * 2
    # the full group holds 5: at 5 the window needs block 4 (gone), at 3 blocks 1-2
    hit = longest_prefix(hashes, windows, BLOCK_SIZE,
                         _finder({0: set(range(5)), 1: {0, 1, 2, 6, 7, 9}}))
    assert hit.num_blocks == 3
    # one group, full attention: the leading run, as without groups
    assert longest_prefix(hashes, (0,), BLOCK_SIZE,
                          _finder({0: {0, 1, 2, 4}})).num_blocks == 3


def test_groups_never_share_cached_pages_of_the_same_tokens():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True, group_windows=(0, 0))
    request = _request("a", list(range(9)), max_tokens=1)
    assert kv.allocate_slots(request, 9)
    tables = kv.block_ids("a")
    assert len(tables) == 2 and not set(tables[0]) & set(tables[1])
    other = _request("b", list(range(9)), max_tokens=1)
    hit = kv.get_computed_blocks(other)
    assert [[block.block_id for block in blocks] for blocks in hit.blocks] == \
        [tables[0][:2], tables[1][:2]]
