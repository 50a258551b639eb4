"""core/_foreach.py: the blocks eager CPU math runs in."""

from __future__ import annotations

import torch

from purestep.core import _foreach as ls


def test_cache_blocks_cover_every_leaf_in_order_and_close_at_the_block_size():
    n = ls.CACHE_BLOCK
    sizes = [10, 20, n, 5, n // 2, n // 2, 3]
    blocks = ls.cache_blocks([torch.empty(k) for k in sizes])
    assert [i for lo, hi in blocks for i in range(lo, hi)] == list(range(len(sizes)))
    assert blocks == [(0, 3), (3, 6), (6, 7)]  # a block closes once it holds CACHE_BLOCK elements
    assert ls.cache_blocks([]) == []
    assert ls.cache_blocks([torch.empty(3 * n), torch.empty(1)]) == [(0, 1), (1, 2)]
