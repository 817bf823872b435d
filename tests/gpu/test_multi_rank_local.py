"""The cross-rank protocol (pull dispatch, scatter to the token's rank, cross-rank
barriers) with R ranks' kernels running side by side on one GPU, each on its own
stream and 1/R of the SMs. The real NVLink run is `torchrun -m tests.gpu.multi_rank`."""
import pytest
import torch

import megamoe_plugin as mm
from megamoe_plugin.heuristics import NUMERICS_MODES
from megamoe_plugin.testing import output_errors, random_inputs

from .multi_rank import MULTI_RANK_SHAPES, launch_side_by_side, make_world, run_local


@pytest.mark.parametrize("numerics", NUMERICS_MODES)
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("shape", MULTI_RANK_SHAPES, ids=lambda s: f"H{s[0]}-I{s[1]}-K{s[2]}-El{s[3]}")
def test_ranks_side_by_side(num_ranks, shape, numerics):
    results = run_local(num_ranks, shape, numerics)
    for step, rank, diff, err in results:
        print(f"\n  R={num_ranks} {numerics} step {step} rank {rank}: calc_diff {diff:.2e} "
              f"{'ok' if err is None else err}", end="")
    failures = [f"step {s} rank {r}: {e}" for s, r, _, e in results if e is not None]
    assert not failures, "\n".join(failures)


def test_a_call_stopped_after_l2_leaves_no_count_to_the_next():
    """A call stopped after L2 (stop_after_phase 6: tools/phase_times.py) still waits for every count
    into its tokens' combine_arrived: the next call zeroes them first, so a peer's add landing after
    that would count into the next call, whose combine would then sum rows before they come. Two
    ranks with unequal token counts alternate stopped and whole calls on the same buffers; every
    whole call is judged."""
    hidden, inter, topk, local_experts, max_tokens, _ = shape = MULTI_RANK_SHAPES[1]
    num_ranks = 2
    experts = local_experts * num_ranks
    layers, gen = make_world(num_ranks, shape, "cuda", 11)
    bufs = mm.buffer.get_local_rank_buffers(num_ranks, experts, max_tokens, topk, hidden, inter)
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    failures = []
    for step in range(16):
        counts = [(max_tokens, 3), (5, max_tokens)][step % 2]
        stopped = [random_inputs(n, hidden, experts, topk, "uniform", "cuda", gen) for n in counts]
        launch_side_by_side(bufs, layers, stopped, streams, max_tokens, "fast", stop_after_phase=6)
        inputs = [random_inputs(n, hidden, experts, topk, "uniform", "cuda", gen) for n in counts[::-1]]
        ys = launch_side_by_side(bufs, layers, inputs, streams, max_tokens, "fast")
        errors = output_errors(ys, inputs, layers, experts, "fast")
        failures += [f"step {step} rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    assert not failures, "\n".join(failures)
