"""The barrier state that lives across calls (buffer.SIGNAL_WORDS) stays right across its
wrap points. Each case puts the state of every rank's buffer a few barriers short of 2^31 or
2^32 (testing.set_barrier_state), runs 20 calls that cross the edge, checks every call
against the reference (alternating numerics modes), and checks the state after: the counts
advanced by exactly the calls' barriers, mod 2^32. R = 1, and R = 2 side by side on one GPU.
(With 32-bit counters compared as signed integers, the first version died here.)"""
import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.buffer import SIGNAL_WORDS
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.kernel_variant import NUM_THREADS
from megamoe_plugin.testing import check_outputs, random_inputs, set_barrier_state

from .multi_rank import launch_side_by_side, make_world

# (hidden, intermediate, topk, local experts, max tokens, _): small, so 20 checked calls are quick
SHAPE = (2048, 768, 8, 8, 96, None)
NUM_CALLS = 20
CROSS_RANK_BARRIERS_PER_CALL = 1  # kernel.cuh: after the send list (the combine waits for its rows)

# kernel.cuh's grid barriers: one after the count (L1 tiles wait for their own rows, and L2 tiles trail
# L1 tiles, in both numerics modes), and none in a call whose entries CTA 0 counts alone.
def grid_barriers(num_tokens: int, topk: int) -> int:
    return int(num_tokens * topk > NUM_THREADS)


EDGE_DISTANCE = 7  # barriers short of the wrap point that each case starts at


@pytest.mark.parametrize("start", [2**31 - EDGE_DISTANCE, 2**32 - EDGE_DISTANCE], ids=["2^31", "2^32"])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_calls_across_the_wrap_point(num_ranks, start):
    hidden, inter, topk, local_experts, max_tokens, _ = SHAPE
    num_experts = local_experts * num_ranks
    layers, gen = make_world(num_ranks, SHAPE, "cuda", seed=start % 1000 + num_ranks)
    bufs = mm.buffer.get_local_rank_buffers(num_ranks, num_experts, max_tokens, topk, hidden, inter)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    # The rounds grow by 1 a call, the grid generation by 0 or 1: token counts on either side of the
    # one-CTA count, two calls each in turn (so each side runs in both numerics modes), so both paths
    # run at the edge and both counters cross it early.
    one_cta_most = NUM_THREADS // topk
    assert 0 < one_cta_most < max_tokens
    set_barrier_state(bufs, grid_generation=start, rank_rounds_done=start)
    grid_advance = [0] * num_ranks
    for call in range(NUM_CALLS):
        low, high = (one_cta_most + 1, max_tokens) if call // 2 % 2 == 0 else (0, one_cta_most)
        tokens = int(torch.randint(low, high + 1, (), generator=gen, device="cuda"))
        numerics = NUMERICS_MODES[call % 2]
        inputs = [random_inputs(tokens if r == 0 else max_tokens - tokens, hidden, num_experts, topk,
                                ("uniform", "masked")[call % 2], "cuda", gen) for r in range(num_ranks)]
        ys = launch_side_by_side(bufs, layers, inputs, streams, tokens, numerics)
        for r in range(num_ranks):
            grid_advance[r] += grid_barriers(inputs[r]["x"].shape[0], topk)
        print(f"\n  R={num_ranks} from {start:#x}: call {call} n={tokens} {numerics}", end="")
        check_outputs(ys, inputs, layers, num_experts, numerics)
    mask = (1 << 32) - 1
    for buf, expected_grid_advance in zip(bufs, grid_advance):
        signals = [int(v) & mask for v in buf.view("signals").cpu()]
        done = signals[SIGNAL_WORDS["rank_barrier_done"]]
        assert done == (start + NUM_CALLS * CROSS_RANK_BARRIERS_PER_CALL) & mask
        arrivals = SIGNAL_WORDS["rank_arrivals"]
        assert [signals[arrivals + 2 * src] for src in range(num_ranks)] == [done] * num_ranks
        assert signals[SIGNAL_WORDS["grid_arrivals"]] == 0
        # Set only by a call that needs more than one pool window (and zeroed by the next call's start):
        # this shape's calls fit the default pools.
        assert signals[SIGNAL_WORDS["windows_pending"]] == 0
        advanced = (signals[SIGNAL_WORDS["grid_generation"]] - start) & mask
        assert advanced == expected_grid_advance
        assert expected_grid_advance > EDGE_DISTANCE  # the grid generation crossed the edge
