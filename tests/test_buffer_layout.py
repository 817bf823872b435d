"""The symmetric buffer's regions hold every routing docs/design.md section 2 allows: the two
arrival counters of every m-block of the worst case (l1_done, rows_arrived), and pools of
pool_capacity rows, which hold the worst routing unless the shape is windowed (its calls then run
their m-blocks in windows of the pools). And the sizes issue 14 bounds: per rank at EP8 with 8192
tokens at most 1 GiB (v4flash) and 2 GiB (v3), linear in the tokens."""
import itertools

import pytest

from megamoe_plugin.buffer import (MIN_BLOCK_M, POOL_ALIGN_M, BufferLayout, BufferShape, get_symm_buffer_size)
from megamoe_plugin.configs import REFERENCE_SHAPES


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
    assert shape.max_pool_rows >= shape.num_max_recv_entries
    for region in ("pool_x", "act", "pool_weight", "pool_src"):
        assert layout.regions[region].shape[0] == shape.pool_capacity
    # A window is pool_capacity / BLOCK_M m-blocks of any tier (kernel.cuh): at least one.
    assert POOL_ALIGN_M <= shape.pool_capacity <= shape.max_pool_rows and shape.pool_capacity % POOL_ALIGN_M == 0
    assert shape.windowed == (shape.pool_capacity < shape.max_pool_rows)
    if ranks == 1:  # one rank's own entries always fit the default pools
        assert not shape.windowed
    for counters in ("l1_done", "rows_arrived"):
        assert layout.regions[counters].shape[0] >= _m_block_bound(shape, MIN_BLOCK_M)
    regions = sorted(layout.regions.values(), key=lambda r: r.offset)
    for a, b in zip(regions, regions[1:]):
        assert a.offset + a.nbytes <= b.offset  # no overlap
        assert b.offset % 256 == 0


def _gib(name, ranks, tokens, **kw):
    ref = REFERENCE_SHAPES[name]
    return get_symm_buffer_size(ranks, ref.num_local_experts * ranks, tokens, ref.num_topk, ref.hidden,
                                ref.intermediate_size, **kw) / 2 ** 30


@pytest.mark.parametrize("name, bound_gib", [("v4flash", 1.0), ("v3", 2.0)])
def test_ep8_buffer_within_the_issue_14_bound(name, bound_gib):
    assert _gib(name, 8, 8192) <= bound_gib
    # Without windows the pools would hold the worst routing: far over the bound.
    worst = BufferShape(8, 256, 8192, REFERENCE_SHAPES[name].num_topk, REFERENCE_SHAPES[name].hidden,
                        REFERENCE_SHAPES[name].intermediate_size).max_pool_rows
    assert _gib(name, 8, 8192, pool_rows=worst) > 2 * bound_gib


@pytest.mark.parametrize("name", ["v3", "v4flash"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_buffer_grows_linearly_with_tokens_not_with_ranks(name, ranks):
    sizes = [_gib(name, ranks, n) for n in (2048, 4096, 8192)]
    assert sizes[2] <= 2.05 * sizes[1] and sizes[1] <= 2.05 * sizes[0]
    assert _gib(name, ranks, 8192) <= 1.01 * _gib(name, 2, 8192)  # the EP width adds only counters


@pytest.mark.parametrize("pool_rows, what", [(100, "a multiple of 128"), (0, "a multiple of 128"),
                                             (1 << 20, "a multiple of 128"), (128.0, "must be an int")])
def test_pool_rows_is_checked(pool_rows, what):
    with pytest.raises((ValueError, TypeError), match=what):
        BufferShape(2, 8, 64, 4, 256, 128, pool_rows)


@pytest.mark.parametrize("ranks,tokens", [(2, 64), (4, 512), (8, 8192)])
def test_window_kernel_launches_cover_the_worst_routing(ranks, tokens):
    """The window kernel's launches per call (csrc/megamoe/kernel.cuh mega_moe_windows): one where it
    loops over the windows, none on unwindowed pools, and at the rebalanced tier (one window per
    launch) enough for the worst routing's m-blocks, in windows of pool_capacity / BLOCK_M."""
    from megamoe_plugin.buffer import window_loop
    from megamoe_plugin.heuristics import IMPLEMENTED_BLOCK_M, REBALANCED_BLOCK_M

    shape = BufferShape(ranks, 32 * ranks, tokens, 8, 7168, 2048)
    assert shape.windowed and not window_loop(REBALANCED_BLOCK_M)
    for block_m in IMPLEMENTED_BLOCK_M:
        launches = shape.window_kernel_launches(block_m)
        if window_loop(block_m):
            assert launches == 1
            continue
        per_window = shape.pool_capacity // block_m
        assert (launches + 1) * per_window >= _m_block_bound(shape, block_m) > launches * per_window
    assert BufferShape(1, 32, tokens, 8, 7168, 2048).window_kernel_launches(REBALANCED_BLOCK_M) == 0
