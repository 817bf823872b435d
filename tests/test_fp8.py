"""FP8 helpers: the exact scale formula, round-trip error bounds, saturation, zero groups,
batch dims, and argument errors."""
import numpy as np
import pytest
import torch

import megamoe_plugin.fp8 as fp8

# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of
# its magnitude; below the smallest normal (2^-6) codes are spaced 2^-9 apart, so the
# absolute error there is at most 2^-10 (in units of the scale).
FP8_HALF_ULP_REL = 2.0 ** -4
FP8_HALF_SUBNORMAL = 2.0 ** -10


def _random(shape, seed, dtype=torch.float32, spread=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if spread:  # magnitudes over several decades, so groups get very different scales
        x = x * torch.exp(4 * torch.randn(shape[:-1] + (1,), generator=gen))
    return x.to(dtype)


def _ieee_scale(amax):
    """max(amax, eps) / 448 as an IEEE float32 quotient, computed by numpy, not torch."""
    amax = np.asarray(amax, dtype=np.float32)
    return torch.from_numpy(np.asarray(np.maximum(amax, np.float32(fp8.SCALE_EPS)) / np.float32(fp8.FP8_MAX)))


def _expected_group_scale(x, group_size):
    return _ieee_scale(x.float().unflatten(-1, (-1, group_size)).abs().amax(-1).numpy())


def _assert_within_fp8_error(approx, exact, scale_per_element):
    bound = FP8_HALF_ULP_REL * exact.abs() + FP8_HALF_SUBNORMAL * scale_per_element
    excess = (approx - exact).abs() - bound * (1 + 1e-6)
    assert excess.max() <= 0, f"fp8 round trip error exceeds the bound by {excess.max():.3e}"


def test_constants():
    assert fp8.FP8_DTYPE == torch.float8_e4m3fn
    assert fp8.FP8_MAX == 448.0 == torch.finfo(torch.float8_e4m3fn).max
    assert fp8.SCALE_EPS == 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("group_size", [128, 64])
def test_per_token_group_scale_formula_and_round_trip(dtype, group_size):
    x = _random((3, 5, 512), seed=group_size, dtype=dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    q, s = fp8.quantize_per_token_group(x, group_size)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (3, 5, 512 // group_size)
    assert torch.equal(s, _expected_group_scale(x, group_size))

    deq = fp8.dequantize_per_token_group(q, s, group_size)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    _assert_within_fp8_error(deq, x.float(), s.repeat_interleave(group_size, -1))
    # The largest element of each group is coded as exactly +-448.
    largest = q.float().unflatten(-1, (-1, group_size)).abs().amax(-1)
    assert torch.all(largest == fp8.FP8_MAX)


def test_input_dtype_only_matters_through_its_values():
    x = _random((4, 256), seed=1, dtype=torch.bfloat16)
    q_bf16, s_bf16 = fp8.quantize_per_token_group(x)
    q_f32, s_f32 = fp8.quantize_per_token_group(x.float())
    assert torch.equal(q_bf16.view(torch.uint8), q_f32.view(torch.uint8)) and torch.equal(s_bf16, s_f32)


def test_requantize_groups_is_the_same_quantization():
    act = _random((7, 256), seed=2)
    for group_size in (64, 128):
        q_a, s_a = fp8.requantize_groups(act, group_size)
        q_b, s_b = fp8.quantize_per_token_group(act, group_size)
        assert torch.equal(q_a.view(torch.uint8), q_b.view(torch.uint8)) and torch.equal(s_a, s_b)


def test_saturation_and_extreme_magnitudes():
    # 552.6327514648438 / (552.6327514648438 / 448) is 448.00003 in float32: the clamp must
    # bring it back to 448 rather than let the cast overflow.
    amax = torch.tensor(552.6327514648438)
    assert amax / (amax / fp8.FP8_MAX) > fp8.FP8_MAX
    x = torch.zeros(3, 128)
    x[0, :3] = torch.tensor([3e38, -3e38, 1.0])
    x[1, :2] = torch.stack([amax, -amax])
    x[2, :2] = torch.tensor([1e-30, -2e-30])  # below the eps: eps scale, codes round to 0
    q, s = fp8.quantize_per_token_group(x)
    assert torch.isfinite(s).all() and not torch.isnan(q.float()).any()
    assert q.float()[0, :3].tolist() == [448.0, -448.0, 0.0]
    assert q.float()[1, :2].tolist() == [448.0, -448.0]
    assert s[2] == _ieee_scale(0.0) and torch.all(q.float()[2] == 0)


def test_zero_groups_get_eps_scale_and_zero_codes():
    x = torch.zeros(2, 3, 256, dtype=torch.bfloat16)
    x[1, 2, 128:] = 1.0  # one non-zero group among zero groups
    q, s = fp8.quantize_per_token_group(x)
    eps_scale = _ieee_scale(0.0)
    zero_groups = torch.ones_like(s, dtype=torch.bool)
    zero_groups[1, 2, 1] = False
    assert torch.all(s[zero_groups] == eps_scale)
    assert s[1, 2, 1] == _ieee_scale(1.0)
    assert torch.all(q.float()[..., :128] == 0)
    assert torch.isfinite(fp8.dequantize_per_token_group(q, s)).all()


def test_weight_blocks_scale_formula_and_round_trip():
    w = _random((2, 256, 384), seed=3, spread=False)
    w[1, 128:, 256:] = 0.0  # an all-zero block
    w[0, :128, :128] *= 1e3  # a block with a very different range
    q, s = fp8.quantize_weight_blocks(w)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (2, 2, 3)
    for e in range(2):
        for nb in range(2):
            for kb in range(3):
                block = w[e, 128 * nb:128 * (nb + 1), 128 * kb:128 * (kb + 1)]
                assert s[e, nb, kb] == _ieee_scale(block.abs().max().item())
    assert torch.all(q[1, 128:, 256:].float() == 0)

    deq = fp8.dequantize_weight_blocks(q, s)
    per_element = s.repeat_interleave(128, -2).repeat_interleave(128, -1)
    assert torch.equal(deq, q.float() * per_element)
    _assert_within_fp8_error(deq, w, per_element)


def test_weight_blocks_other_block_size_and_batch_dims():
    w = _random((2, 3, 128, 64), seed=4, dtype=torch.bfloat16, spread=False)
    q, s = fp8.quantize_weight_blocks(w, block=64)
    assert s.shape == (2, 3, 2, 1)
    deq = fp8.dequantize_weight_blocks(q, s, block=64)
    _assert_within_fp8_error(deq, w.float(), s.repeat_interleave(64, -2).repeat_interleave(64, -1))


@pytest.mark.parametrize("call, error, match", [
    (lambda: fp8.quantize_per_token_group(torch.zeros(2, 200)), ValueError,
     r"x\.shape\[-1\]=200 is not divisible by group_size=128"),
    (lambda: fp8.requantize_groups(torch.zeros(2, 96), 64), ValueError,
     r"act\.shape\[-1\]=96 is not divisible by group_size=64"),
    (lambda: fp8.quantize_per_token_group(torch.zeros(2, 128), 0), ValueError, r"group_size must be a positive int"),
    (lambda: fp8.quantize_per_token_group(torch.zeros(2, 128, dtype=torch.int32)), ValueError, r"x must be one of"),
    (lambda: fp8.quantize_per_token_group(torch.zeros(2, 128).to(fp8.FP8_DTYPE)), ValueError, r"x must be one of"),
    (lambda: fp8.quantize_per_token_group([1.0] * 128), TypeError, r"x must be a torch\.Tensor"),
    (lambda: fp8.dequantize_per_token_group(torch.zeros(2, 256), torch.ones(2, 2)), ValueError,
     r"q must be torch\.float8_e4m3fn"),
    (lambda: fp8.dequantize_per_token_group(torch.zeros(2, 256).to(fp8.FP8_DTYPE), torch.ones(2, 2).half()),
     ValueError, r"s must be torch\.float32"),
    (lambda: fp8.dequantize_per_token_group(torch.zeros(2, 256).to(fp8.FP8_DTYPE), torch.ones(2, 4)),
     ValueError, r"s must have shape \(2, 2\)"),
    (lambda: fp8.quantize_weight_blocks(torch.zeros(130, 128)), ValueError,
     r"w\.shape\[-2\]=130 is not divisible by block=128"),
    (lambda: fp8.quantize_weight_blocks(torch.zeros(128, 100)), ValueError,
     r"w\.shape\[-1\]=100 is not divisible by block=128"),
    (lambda: fp8.quantize_weight_blocks(torch.zeros(256)), ValueError, r"w must have at least 2 dims"),
    (lambda: fp8.dequantize_weight_blocks(torch.zeros(2, 256, 128).to(fp8.FP8_DTYPE), torch.ones(2, 1, 2)),
     ValueError, r"s must have shape \(2, 2, 1\)"),
])
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
