"""KV pages of every head over a cache cut by KV head (engine/kv_pages.py): what a group's
leader reads and writes equals the same operation on the whole cache, for every split the
tensor-parallel sizes allow (heads shared out, and replicated where ranks outnumber them), and
pages move between caches cut differently (a prefill group of one size, a decode group of
another)."""
from __future__ import annotations

import pytest
import torch

from kvrelay.engine.kv_pages import KvPages, map_kv_pages
from kvrelay.engine.parallel.shard import group_kv_heads

SLOTS, BLOCKS, BLOCK_SIZE, ROW = 3, 7, 4, 8


def _whole(heads: int, dtype: torch.dtype) -> torch.Tensor:
    cache = torch.randn(SLOTS, 2, BLOCKS, BLOCK_SIZE, heads, ROW)
    return cache.to(dtype)


def _cut(whole: torch.Tensor, size: int) -> KvPages:
    """The cache as a group of `size` ranks holds it: each rank's heads, contiguous."""
    heads_of = group_kv_heads(whole.shape[4], size)
    shards = [whole[:, :, :, :, heads].clone() for heads in heads_of]
    return KvPages(shards, heads_of)


def _joined(pages: KvPages) -> torch.Tensor:
    """Back to the whole cache (checking replicas agree)."""
    heads = pages.num_heads
    out = torch.empty(*pages.shards[0].shape[:4], heads, ROW, dtype=pages.dtype)
    for shard, shard_heads in zip(pages.shards, pages.heads_of):
        for position, head in enumerate(shard_heads):
            out[..., head, :] = shard[..., position, :]
            assert torch.equal(out[..., head, :].view(torch.uint8),
                               shard[..., position, :].view(torch.uint8))
    return out


SPLITS = [(4, 1), (4, 2), (4, 4), (2, 4), (1, 3), (6, 3)]  # (KV heads, ranks)
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


@pytest.mark.parametrize("heads,size", SPLITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reading_a_cut_cache_gives_every_head_in_order(heads, size, dtype):
    whole = _whole(heads, dtype)
    pages = _cut(whole, size)
    index = torch.tensor([5, 0, 3])
    expected = whole[1].index_select(1, index)
    got = pages.read(1, index)
    assert got.shape == (2, 3, BLOCK_SIZE, heads, ROW) and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(pages.block(6).view(torch.uint8), whole[:, :, 6].view(torch.uint8))
    assert pages.page_shape == (BLOCK_SIZE, heads, ROW)
    assert pages.block_bytes == whole[:, :, 0].numel() * whole.element_size()


@pytest.mark.parametrize("heads,size", SPLITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_writing_a_cut_cache_reaches_every_replica(heads, size, dtype):
    whole = _whole(heads, dtype)
    pages = _cut(whole, size)
    incoming = _whole(heads, dtype)[2, 1, :2]  # [2 blocks, block_size, heads, row]
    index = torch.tensor([4, 1])
    pages.write(2, 1, index, incoming)
    whole.view(torch.uint8)[2, 1].index_copy_(0, index, incoming.view(torch.uint8))
    assert torch.equal(_joined(pages).view(torch.uint8), whole.view(torch.uint8))


@pytest.mark.parametrize("heads,source_size,destination_size",
                         [(4, 2, 1), (4, 1, 2), (4, 2, 4), (2, 4, 1), (2, 1, 4), (6, 3, 2)])
def test_blocks_move_between_caches_cut_differently(heads, source_size, destination_size):
    source_whole = _whole(heads, torch.bfloat16)
    destination_whole = _whole(heads, torch.bfloat16)
    source = _cut(source_whole, source_size)
    destination = _cut(destination_whole, destination_size)
    written = destination.copy_blocks_from(source, [6, 2], [0, 5])
    destination_whole[:, :, [0, 5]] = source_whole[:, :, [6, 2]]
    assert torch.equal(_joined(destination), destination_whole)
    assert written == 2 * destination.block_bytes


@pytest.mark.parametrize("heads,size", [(4, 2), (2, 4), (4, 1)])
def test_a_group_cache_file_maps_as_its_ranks_cut_it(tmp_path, heads, size):
    """A group's file holds rank r's shard in its r-th region (parallel/group_kv.py)."""
    whole = _whole(heads, torch.bfloat16)
    cut = _cut(whole, size)
    path = tmp_path / "group.kv"
    path.write_bytes(b"".join(shard.contiguous().view(torch.uint8).numpy().tobytes()
                              for shard in cut.shards))
    mapped = map_kv_pages(str(path), torch.bfloat16, (SLOTS, BLOCK_SIZE, heads, ROW), size)
    assert mapped.num_blocks == BLOCKS and mapped.heads_of == cut.heads_of
    assert torch.equal(_joined(mapped), whole)
    mapped.write(0, 0, torch.tensor([3]), whole[1, 1, :1])  # writes reach the file
    reread = map_kv_pages(str(path), torch.bfloat16, (SLOTS, BLOCK_SIZE, heads, ROW), size)
    assert torch.equal(reread.read(0, torch.tensor([3]))[0], whole[1, 1, :1])


def test_a_head_in_no_shard_is_refused():
    with pytest.raises(ValueError, match="KV head 1 is in no shard"):
        KvPages([torch.zeros(1, 2, 1, 1, 1, 1)] * 2, [[0], [2]])
