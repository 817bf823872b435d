"""The cross-rank protocol (pull dispatch, scatter to the token's rank, cross-rank
barriers) with R ranks' kernels running side by side on one GPU, each on its own
stream and 1/R of the SMs. The real NVLink run is `torchrun -m tests.gpu.multi_rank`."""
import pytest

from megamoe_plugin.heuristics import NUMERICS_MODES

from .multi_rank import MULTI_RANK_SHAPES, run_local


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
