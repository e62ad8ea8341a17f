"""A tensor-parallel group's KV cache in one shared file: rank r's shard (a contiguous cache of
its KV heads) is the file's r-th region. Every rank maps the file and computes on its region;
the leader sees every region, which is how it reads and writes the pages of all the model's
heads for the KV connector (engine/kv_pages.py) while the ranks compute.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from kvrelay.engine import shared_pages


def allocate_group_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, path: str,
                            rank: int, size: int) -> list[torch.Tensor]:
    """Every rank calls this together (collectives inside). shape: one rank's cache [slots, 2,
    num_blocks, block_size, local_kv_heads, row_width]. Returns every rank's region on the
    leader, this rank's alone on the others. The leader creates the file and commits its pages
    (a filesystem without room fails here, on every rank, not with SIGBUS in a step); each rank
    faults in its own region, where it computes."""
    region_bytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    problem = None
    if rank == 0:
        try:
            shared_pages.reserve(path, region_bytes * size)
        except OSError as exc:
            problem = exc
    all_or_none(problem)
    whole = torch.from_file(path, shared=True, size=region_bytes * size, dtype=torch.uint8)
    regions = [whole[r * region_bytes:(r + 1) * region_bytes].view(dtype).view(shape)
               for r in range(size)]
    shared_pages.populate(regions[rank].view(torch.uint8).view(-1))
    dist.barrier()  # every rank has mapped it: the owner may unlink a private file now
    return regions if rank == 0 else [regions[rank]]


def all_or_none(problem: Exception | None) -> None:
    """Raise on every rank if any rank failed (none is left waiting in a collective)."""
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32)
    dist.all_reduce(flag)
    if problem is not None:
        raise problem
    if int(flag):
        raise RuntimeError("the group's leader could not create its KV cache file")
