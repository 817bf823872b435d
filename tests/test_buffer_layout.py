"""The symmetric buffer's regions hold every routing docs/design.md section 2 allows: the pool
rows of the worst case, and the two arrival counters of every m-block of the pool: its L1 tiles
(l1_done) and its pulled rows (rows_arrived)."""
import itertools

import pytest

from megamoe_plugin.buffer import MIN_BLOCK_M, BufferLayout, BufferShape


def _m_block_bound(shape: BufferShape, block_m: int) -> int:
    """No routing makes more m-blocks than this: with c_e entries on expert e (sum c_e =
    all entries, at most min(E_l, entries) experts non-empty), sum ceil(c_e / block_m)
    <= (entries + (block_m - 1) * busy) / block_m."""
    entries = shape.num_max_recv_entries
    busy = min(shape.num_local_experts, entries)
    return (entries + (block_m - 1) * busy) // block_m


@pytest.mark.parametrize("ranks,experts,tokens,topk", list(itertools.product(
    (1, 2, 8), (8, 128, 512), (1, 3, 64, 129, 4096), (1, 6, 16))))
def test_regions_hold_the_worst_routing(ranks, experts, tokens, topk):
    if topk > experts or experts % ranks:
        pytest.skip("not a valid shape")
    shape = BufferShape(ranks, experts, tokens, topk, 256, 128)
    layout = BufferLayout(shape)
    assert layout.regions["pool_x"].shape[0] == shape.pool_capacity >= shape.num_max_recv_entries
    for counters in ("l1_done", "rows_arrived"):
        assert layout.regions[counters].shape[0] >= _m_block_bound(shape, MIN_BLOCK_M)
    regions = sorted(layout.regions.values(), key=lambda r: r.offset)
    for a, b in zip(regions, regions[1:]):
        assert a.offset + a.nbytes <= b.offset  # no overlap
        assert b.offset % 256 == 0
