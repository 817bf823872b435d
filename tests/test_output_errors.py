"""testing.output_errors, the GPU tests' judge, on made-up outputs (no kernel, no GPU): every token on
its rank, calc_diff over the call's whole output (docs/design.md section 2), every failing check named,
and fast mode's misses against the exact reference excused only where the FP8-tensor-core reference
misses as far. The references are stubbed, so fast mode's second check (cuBLAS FP8) needs no GPU here."""
import math

import pytest
import torch

from megamoe_plugin import testing
from megamoe_plugin.reference import calc_diff

H = 256


def _rows(n, seed):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _with_error(ref, rel):
    """ref plus noise of relative L2 norm `rel` in every row."""
    noise = _rows(ref.shape[0], 99)
    return ref + noise * (rel * ref.norm(dim=1, keepdim=True) / noise.norm(dim=1, keepdim=True))


@pytest.fixture
def judge(monkeypatch):
    """output_errors against stubbed references (they ignore the inputs and layers): `refs` the exact
    one, `tc_refs` (default: the outputs themselves) the FP8-tensor-core one."""
    def run(ys, refs, numerics="fast", tc_refs=None):
        def reference_outputs(inputs, layers, num_experts, activation_clamp=None, l1_gemm=None):
            if l1_gemm is None:
                return refs
            assert l1_gemm is testing.fp8_tensor_core_l1
            return tc_refs if tc_refs is not None else [y.clone() for y in ys]
        monkeypatch.setattr(testing, "reference_outputs", reference_outputs)
        return testing.output_errors(ys, [None] * len(ys), [None] * len(ys), 8, numerics)
    return run


def test_a_one_token_rank_is_judged_within_the_call(judge):
    refs = [_rows(1, 0), _rows(64, 1)]
    ys = [_with_error(refs[0], 2e-2), refs[1].clone()]  # alone, rank 0's calc_diff is ~2e-4 > 5e-5
    assert calc_diff(ys[0], refs[0]) > 1e-4
    assert judge(ys, refs, tc_refs=[refs[0].clone(), refs[1].clone()])[1] is None
    assert "exact reference" not in (judge(ys, refs, tc_refs=[ys[0].clone(), refs[1].clone()])[0] or "")
    # The second check still holds each token to 1e-2 against the FP8-tensor-core reference.
    errors = judge(ys, refs, tc_refs=refs)
    assert errors[1] is None and "FP8-tensor-core reference" in errors[0] and "exact reference" not in errors[0]


def test_a_token_over_its_bound_fails_its_rank_only(judge):
    refs = [_rows(1, 0), _rows(64, 1)]
    ys = [_with_error(refs[0], 4e-2), refs[1].clone()]  # fast: 3e-2 per token vs exact, 1e-2 vs FP8 TC
    errors = judge(ys, refs, tc_refs=refs)
    assert errors[1] is None
    assert "exact reference" in errors[0] and "FP8-tensor-core reference" in errors[0]  # both checks named
    assert "tokens have relative L2 error" in errors[0]


def test_the_whole_calls_calc_diff_fails_every_rank(judge):
    refs = [_rows(32, 0), _rows(32, 1)]
    ys = [_with_error(r, 1.2e-2) for r in refs]  # every token under 3e-2, calc_diff ~7e-5 > 5e-5
    errors = judge(ys, refs, tc_refs=refs)
    assert all("the call's calc_diff over all 2 ranks' rows" in e for e in errors)
    assert all("exact reference" in e for e in errors)


def test_nan_fails_and_names_its_rank(judge):
    refs = [_rows(4, 0), _rows(4, 1)]
    ys = [refs[0].clone(), refs[1].clone()]
    ys[1][2, 5] = math.nan
    errors = judge(ys, refs, numerics="exact")
    assert "y has 1 NaN" in errors[1]
    assert errors[0] is not None and "calc_diff" in errors[0]  # the call's calc_diff is NaN


def test_empty_ranks_pass(judge):
    refs = [torch.zeros(0, H, dtype=torch.float64), _rows(3, 1)]
    assert judge([refs[0].clone(), refs[1].clone()], refs, numerics="exact") == [None, None]


def test_a_miss_that_fp8_tensor_cores_make_too_passes(judge):
    refs = [_rows(1, 0), _rows(16, 1)]
    tc = [_with_error(refs[0], 3.05e-2), refs[1].clone()]  # cuBLAS FP8 L1 itself over 3e-2 and 5e-5
    ys = [tc[0].clone(), refs[1].clone()]
    assert judge(ys, refs, tc_refs=tc) == [None, None]


def test_a_miss_beyond_fp8_tensor_cores_fails(judge):
    refs = [_rows(1, 0), _rows(16, 1)]
    tc = [_with_error(refs[0], 3.05e-2), refs[1].clone()]
    ys = [_with_error(refs[0], 4.5e-2), refs[1].clone()]  # over 1.25 x the tensor cores' own miss
    errors = judge(ys, refs, tc_refs=tc)
    assert "fast numerics vs the exact reference: y does not match" in errors[0]
    assert "the FP8-tensor-core reference itself vs the exact one" in errors[0]


def test_nan_is_never_excused(judge):
    refs = [_rows(4, 0)]
    ys = [refs[0].clone()]
    ys[0][1, 3] = math.nan
    errors = judge(ys, refs)  # the FP8-tensor-core stub holds the NaN too
    assert "y has 1 NaN" in errors[0] and "exact reference" in errors[0]
