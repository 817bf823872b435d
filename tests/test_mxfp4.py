"""MXFP4 expert weights (docs/design.md section 2, "FP4 experts"): the exact dequantization in vLLM's
nibble order, the quantizer, the checkpoint validation, and the reference on MXFP4 weights, which
must equal the reference on the same values held as FP8 blocks. Their kernel layout:
tests/test_mxfp4_kernel_layout.py."""
import pytest
import torch

from megamoe_plugin import mxfp4
from megamoe_plugin.fp8 import FP8_DTYPE
from megamoe_plugin.reference import mega_moe
from megamoe_plugin.testing import random_inputs, reference_ranks
from megamoe_plugin.weights import dequantize_weight, validate_checkpoint_weights


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _random_codes(shape, gen):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def test_every_code_in_both_nibbles():
    codes = torch.arange(16, dtype=torch.uint8)
    low_only = mxfp4.unpack_e2m1(codes)  # high nibble 0
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert low_only[0::2].tolist() == values + [-v for v in values]
    assert (low_only[1::2] == 0).all()
    high_only = mxfp4.unpack_e2m1(codes << 4)
    assert high_only[1::2].tolist() == values + [-v for v in values] and (high_only[0::2] == 0).all()
    assert mxfp4.unpack_e2m1(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [0.5, 1.0]  # low nibble first


def test_scales_are_exact_powers_of_two_in_either_dtype():
    bits = torch.tensor([0, 1, 100, 127, 128, 200, 254], dtype=torch.uint8)
    want = [2.0 ** (int(b) - 127) for b in bits]
    assert mxfp4.scale_to_float(bits).tolist() == want
    assert mxfp4.scale_to_float(bits.view(torch.float8_e8m0fnu)).tolist() == want
    assert torch.isnan(mxfp4.scale_to_float(torch.tensor([255], dtype=torch.uint8))).all()
    with pytest.raises(ValueError, match="w13_scale must be E8M0 scales"):
        mxfp4.scale_to_float(torch.ones(2), "w13_scale")


def test_float32_e8m0_values_give_back_their_codes_and_anything_else_is_named():
    codes = torch.arange(0, 256, dtype=torch.uint8)  # 2^-127 (a float32 subnormal) .. 2^127, and NaN
    assert torch.equal(mxfp4.scale_bits_of_float(mxfp4.scale_to_float(codes)), codes)
    for bad in (3.0, 0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match=rf"w13_scale must hold E8M0 values .* e\.g\. \[{bad}\]"):
            mxfp4.scale_bits_of_float(torch.tensor([1.0, bad]), "w13_scale")
    with pytest.raises(ValueError, match="w13_scale must be float32"):
        mxfp4.scale_bits_of_float(codes, "w13_scale")


def test_dequantization_is_vllms():
    vllm_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.flashinfer_moe_ep")
    gen = _gen(0)
    packed = _random_codes((64, 128), gen)
    scale = torch.randint(110, 140, (64, 8), generator=gen, dtype=torch.int32).to(torch.uint8)
    ours = mxfp4.dequantize_mxfp4(packed, scale)
    theirs = vllm_moe._dequant_mxfp4_ue8m0_gran32(packed, scale.view(torch.float8_e8m0fnu)).float()
    assert torch.equal(ours, theirs)  # the values are exact in bf16 too: E2M1 times a power of two


def test_quantizer_rounds_to_nearest_even_and_saturates():
    # amax 7.5 puts the group's scale at 2^(floor(log2 7.5) - 2) = 1: the values are in E2M1 units.
    row = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5, -0.25, -0.75, -5.0, 2.9] + [0.0] * 20
    nearest_even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -4.0, 3.0] + [0.0] * 20
    for exponent in (0, -3, 5):
        packed, scale = mxfp4.quantize_mxfp4(torch.tensor([row]) * 2.0 ** exponent)
        assert scale.view(torch.uint8).tolist() == [[127 + exponent]]
        assert (mxfp4.dequantize_mxfp4(packed, scale)[0] / 2.0 ** exponent).tolist() == nearest_even
    zeros, zero_scale = mxfp4.quantize_mxfp4(torch.zeros(1, 32))
    assert (zeros == 0).all() and zero_scale.view(torch.uint8).tolist() == [[0]]


def test_values_on_the_grid_survive_a_round_trip():
    gen = _gen(1)
    packed = _random_codes((32, 256), gen)
    scale = torch.randint(100, 150, (32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    values = mxfp4.dequantize_mxfp4(packed, scale)
    again = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(values))
    assert torch.equal(again, values)


def _mxfp4_layer(num_local_experts, hidden, inter, gen):
    """MXFP4 checkpoint weights whose scales are constant on each 128x128 block, with their values
    as FP8 128x128 blocks: E2M1 codes are exact e4m3, and a block's one power of two is its scale."""
    def one(rows, cols):
        packed = _random_codes((num_local_experts, rows, cols // 2), gen)
        block_bits = torch.randint(118, 124, (num_local_experts, rows // 128, cols // 128), generator=gen,
                                   dtype=torch.int32)
        scale = block_bits.repeat_interleave(128, 1).repeat_interleave(4, 2).to(torch.uint8)
        as_fp8 = mxfp4.unpack_e2m1(packed).to(FP8_DTYPE)
        block_scale = torch.ldexp(torch.ones(block_bits.shape), block_bits - 127)
        return (packed, scale.view(torch.float8_e8m0fnu)), (as_fp8, block_scale)

    (w13, w13_scale), (f13, f13_scale) = one(2 * inter, hidden)
    (w2, w2_scale), (f2, f2_scale) = one(hidden, inter)
    return (dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale),
            dict(w13=f13, w13_scale=f13_scale, w2=f2, w2_scale=f2_scale))


@pytest.mark.parametrize("num_ranks, local_experts, topk, hidden, inter, routing", [
    (1, 4, 2, 256, 256, "uniform"),
    (2, 2, 3, 384, 128, "masked"),
    (4, 1, 1, 128, 256, "one_expert"),
])
def test_the_reference_on_mxfp4_weights_is_the_reference_on_their_values(num_ranks, local_experts, topk, hidden,
                                                                       inter, routing):
    gen = _gen(2)
    layers = [_mxfp4_layer(local_experts, hidden, inter, gen) for _ in range(num_ranks)]
    for packed, blocks in layers:
        assert torch.equal(dequantize_weight(packed["w13"][0], packed["w13_scale"][0]),
                           dequantize_weight(blocks["w13"][0], blocks["w13_scale"][0]))
    inputs = [random_inputs(n, hidden, local_experts * num_ranks, topk, routing, "cpu", gen)
              for n in [5, 0, 7, 1][:num_ranks]]
    ranks = reference_ranks(inputs)
    ys = mega_moe(ranks, [packed for packed, _ in layers], local_experts * num_ranks)
    want = mega_moe(ranks, [blocks for _, blocks in layers], local_experts * num_ranks)
    for y, w in zip(ys, want):
        assert torch.equal(y, w)
    assert any(bool(y.abs().sum() > 0) for y in ys)


def _valid_mxfp4(local=2, hidden=256, inter=128):
    packed, _ = _mxfp4_layer(local, hidden, inter, _gen(3))
    return packed


@pytest.mark.parametrize("change, match", [
    (lambda w: w.update(w2=w["w2"].view(torch.int8)), r"w2 must be torch.uint8, got torch.int8 \(w13 is MXFP4"),
    (lambda w: w.update(w13_scale=w["w13_scale"].float()), "w13_scale must be E8M0 scales"),
    (lambda w: w.update(w13_scale=w["w13_scale"][:, :, :4]), r"w13_scale must have shape \[E_local, 2\*I, H/32\]"),
    (lambda w: w.update(w2=w["w2"][:, :, :32]), r"w2 must have shape \[E_local, H, I/2\]"),
    (lambda w: w.update(w13=w["w13"][:, :, :96], w13_scale=w["w13_scale"][:, :, :6]),
     r"hidden size H = w13.shape\[2\] \* 2 = 192 must be a multiple of 128"),
])
def test_bad_mxfp4_weights_are_named(change, match):
    w = _valid_mxfp4()
    change(w)
    with pytest.raises(ValueError, match=match):
        validate_checkpoint_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])


def test_mxfp4_checkpoint_shape_and_one_format_per_model():
    w = _valid_mxfp4(local=3, hidden=384, inter=256)
    assert validate_checkpoint_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"]) == (3, 384, 256)
    packed, blocks = _mxfp4_layer(1, 128, 128, _gen(4))
    ranks = reference_ranks([random_inputs(2, 128, 2, 1, "uniform", "cpu", _gen(5)) for _ in range(2)])
    with pytest.raises(ValueError, match="one format"):
        mega_moe(ranks, [packed, blocks], 2)


def _codes_and_bits(shape_codes, low, high, seed):
    gen = _gen(seed)
    packed = _random_codes(shape_codes, gen)
    bits = torch.randint(low, high + 1, (*shape_codes[:-1], shape_codes[-1] * 2 // 32), generator=gen,
                         dtype=torch.int32).to(torch.uint8)
    return packed, bits


def test_to_fp8_blocks_is_exact_within_a_span_of_2_to_the_14():
    packed, bits = _codes_and_bits((2, 256, 192), 108, 122, 11)  # spans up to 14 in every block
    q, s = mxfp4.to_fp8_blocks(packed, bits.view(torch.float8_e8m0fnu))
    assert q.dtype == FP8_DTYPE and q.shape == (2, 256, 384) and s.shape == (2, 2, 3)
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))  # powers of two
    assert torch.equal(dequantize_weight(q, s), mxfp4.dequantize_mxfp4(packed, bits))


def test_to_fp8_blocks_names_a_block_it_cannot_hold_and_rounds_on_request():
    packed = torch.full((1, 128, 64), 0x11, dtype=torch.uint8)  # every code 0.5
    bits = torch.full((1, 128, 4), 127, dtype=torch.uint8)
    packed[0, 0, 0] = 0x77  # a 6 in the top group sets the block's scale
    bits[0, 5, 3] = 127 - 14
    assert torch.equal(dequantize_weight(*mxfp4.to_fp8_blocks(packed, bits)), mxfp4.dequantize_mxfp4(packed, bits))
    bits[0, 5, 3] = 127 - 15  # its 0.5 x 2^-15 is below e4m3's least value at this block's scale
    with pytest.raises(ValueError, match=r"block \(0, 0, 0\) does not fit FP8 exactly"):
        mxfp4.to_fp8_blocks(packed, bits)
    rounded = dequantize_weight(*mxfp4.to_fp8_blocks(packed, bits, exact=False))
    changed = rounded != mxfp4.dequantize_mxfp4(packed, bits)
    assert changed[0, 5, 96:128].all() and changed.sum() == 32  # that group alone


def test_to_fp8_blocks_of_zeros_and_bad_shapes():
    q, s = mxfp4.to_fp8_blocks(torch.zeros(128, 64, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8))
    assert (q.float() == 0).all() and s.tolist() == [[1.0]]
    with pytest.raises(ValueError, match="multiples of 128"):
        mxfp4.to_fp8_blocks(torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8))


def test_the_reference_on_mxfp4_weights_is_the_reference_on_their_fp8_blocks():
    gen = _gen(12)
    weights = []
    for _ in range(2):
        w13, w13_bits = _codes_and_bits((2, 256, 128), 115, 125, int(torch.randint(0, 1000, (1,), generator=gen)))
        w2, w2_bits = _codes_and_bits((2, 256, 64), 115, 125, int(torch.randint(0, 1000, (1,), generator=gen)))
        weights.append(dict(w13=w13, w13_scale=w13_bits, w2=w2, w2_scale=w2_bits))
    blocks = []
    for w in weights:
        f13, s13 = mxfp4.to_fp8_blocks(w["w13"], w["w13_scale"])
        f2, s2 = mxfp4.to_fp8_blocks(w["w2"], w["w2_scale"])
        blocks.append(dict(w13=f13, w13_scale=s13, w2=f2, w2_scale=s2))
    ranks = reference_ranks([random_inputs(n, 256, 4, 2, "masked", "cpu", gen) for n in (6, 3)])
    for y, want in zip(mega_moe(ranks, weights, 4), mega_moe(ranks, blocks, 4)):
        assert torch.equal(y, want)
