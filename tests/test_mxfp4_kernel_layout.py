"""MXFP4 expert weights on their way to the kernel (CPU): the kernel layout transform_weights makes
and undoes, the variants and shared memory the kernel reads them with (csrc/megamoe/fp4_weights.cuh),
and their pre-building."""
import pytest
import torch

from megamoe_plugin import abi
from megamoe_plugin.buffer import BufferShape
from megamoe_plugin.heuristics import (MIN_STAGES, default_num_stages, implemented_block_m, kernel_weight_format,
                                      min_pipeline_stages)
from megamoe_plugin.jit.cli import parser
from megamoe_plugin.jit.command import build_command
from megamoe_plugin.model_config import MoEShape
from megamoe_plugin.mxfp4 import MXFP4_GROUP, fold_blocks, from_kernel_codes, to_kernel_codes
from megamoe_plugin.variants import build_variants_for, variant_for
from megamoe_plugin.weights import kernel_layout_shapes, transform_weights, untransform_weights


def _mxfp4(gen, experts, rows, cols):
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen)
    return codes, scales


@pytest.mark.parametrize("hidden,inter", [(384, 256), (256, 128), (640, 384)])
def test_transform_round_trip_and_layout(hidden, inter):
    gen = torch.Generator().manual_seed(hidden + inter)
    experts = 3
    w13, s13 = _mxfp4(gen, experts, 2 * inter, hidden)
    w2, s2 = _mxfp4(gen, experts, hidden, inter)
    (w13_t, s13_t), (w2_t, s2_t) = transform_weights((w13, s13), (w2, s2))
    shapes = kernel_layout_shapes("mxfp4", experts, hidden, inter)
    for key, tensor in (("w13", w13_t), ("w13_scale", s13_t), ("w2", w2_t), ("w2_scale", s2_t)):
        assert tuple(tensor.shape) == shapes[key][0] and tensor.dtype == shapes[key][1], key
    # Interleaved row 11 is up row 3 (runs of 8 gate rows, then 8 up rows); in tile [e, 0, k] row 11,
    # its bytes of k-block k (in the kernel's order of signs); its k-block 1 scales are groups 4-7.
    assert torch.equal(w13_t[1, 0, 1, 11], to_kernel_codes(w13[1, inter + 3, 64:128]))
    assert torch.equal(s13_t[1, 0, 1, 11], s13[1, inter + 3, 4:8])
    assert torch.equal(s2_t[2, 0, 0, 5], s2[2, 5, 0:4])
    if hidden % 256:  # w2's rows past H in its last tile
        assert int(w2_t[:, -1, :, hidden % 256:].sum()) == 0 and int(s2_t[:, -1, :, hidden % 256:256].sum()) == 0
    (a, b), (c, d) = untransform_weights((w13_t, s13_t), (w2_t, s2_t))
    assert torch.equal(a, w13) and torch.equal(b, s13) and torch.equal(c, w2) and torch.equal(d, s2)


def test_transformed_scales_of_another_layout_are_refused():
    gen = torch.Generator().manual_seed(1)
    w13, s13 = _mxfp4(gen, 2, 256, 256)
    w2, s2 = _mxfp4(gen, 2, 256, 128)
    (w13_t, s13_t), (w2_t, s2_t) = transform_weights((w13, s13), (w2, s2))
    with pytest.raises(ValueError, match="w13_scale must have the kernel layout"):
        untransform_weights((w13_t, s13), (w2_t, s2_t))
    with pytest.raises(ValueError, match=r"w13 must be MXFP4 in the kernel layout"):
        untransform_weights((w13, s13_t), (w2_t, s2_t))


def test_mxfp4_variants_run_every_fast_tier():
    assert implemented_block_m("fast", "mxfp4") == implemented_block_m("fast")
    assert implemented_block_m("exact", "mxfp4") == ()
    assert [kernel_weight_format(w, n) for w in ("mxfp4", "fp8") for n in ("fast", "exact")] == \
        ["mxfp4", "fp8", "fp8", "fp8"]
    shape = BufferShape.of_routed(1, 32, 8192, 6, 4096, 2048)
    tiers = []
    for tokens in (1, 8, 128, 8192):
        v = variant_for(shape, "NVIDIA H100 80GB HBM3", 132, tokens, True, "fast", weights="mxfp4")
        assert v.weights == "mxfp4" and v.num_stages >= min_pipeline_stages(v.block_m, "mxfp4")
        assert v.name().endswith("_w4") and "true>" in v.source().split("KernelConfig<")[1].split(";")[0]
        tiers.append(v.block_m)
    assert tiers[0] < 64 and tiers[-1] == 128  # swap-AB at decode, the cooperative tier at prefill
    with pytest.raises(ValueError, match="fast numerics only"):
        variant_for(shape, "NVIDIA H100 80GB HBM3", 132, 8, True, "exact", weights="mxfp4")


def test_the_two_tile_tiers_need_three_stages():
    """BLOCK_M 64 and 128 convert the next k-block's MXFP4 stage while they hold the current one and the
    one before: two stages would wait on each other, so they are refused by name."""
    assert [min_pipeline_stages(bm, "mxfp4") for bm in (8, 16, 32, 64, 128)] == [2, 2, 2, 3, 3]
    assert all(min_pipeline_stages(bm) == MIN_STAGES for bm in (8, 16, 32, 64, 128))
    shape = BufferShape.of_routed(1, 32, 8192, 6, 4096, 2048)
    with pytest.raises(ValueError, match="num_stages=2 .MEGAMOE_NUM_STAGES. is too few: block_m=128"):
        variant_for(shape, "NVIDIA H100 80GB HBM3", 132, 8192, True, "fast", forced_num_stages=2, weights="mxfp4")
    assert variant_for(shape, "NVIDIA H100 80GB HBM3", 132, 8192, True, "fast", forced_num_stages=3,
                       weights="mxfp4").num_stages == 3
    assert variant_for(shape, "NVIDIA H100 80GB HBM3", 132, 1, True, "fast", forced_num_stages=2,
                       weights="mxfp4").num_stages == 2


def test_the_kernel_and_the_format_agree_on_the_group_size():
    """One E8M0 scale per 32 inputs: the OCP MX format's constant (mxfp4) is the kernel's (abi.h)."""
    assert abi.kFp4GroupSize == MXFP4_GROUP and abi.kFp4ScaleBytesPerRow == abi.kBlockK // MXFP4_GROUP


def test_a_mxfp4_stage_carries_half_the_weight_bytes():
    fp8 = abi.smem_plan(8, 2, 32, False, False)
    fp4 = abi.smem_plan(8, 2, 32, False, True)
    weight_bytes = abi.kBlockN * abi.kBlockK
    assert fp4["stage"] <= fp8["stage"] - weight_bytes // 2 + abi.kBlockN * abi.kFp4ScaleBytesPerRow + 1024
    # The converted FP8 tile, outside the ring.
    assert fp4["stages"] - fp4["fp4_tile"] == weight_bytes
    assert fp8["stages"] == fp8["fp4_tile"]
    assert default_num_stages(8, 32, 4096, 2048, weights="mxfp4") > default_num_stages(8, 32, 4096, 2048)


def test_prebuilding_knows_the_weight_format():
    """jit --build --weights mxfp4 builds the MXFP4 variants, and a missing kernel's command says so."""
    variants = build_variants_for(MoEShape(4096, 2048, 256, 6), 8, [1, 8, 128, 1024], "NVIDIA H100 80GB HBM3",
                                  ("fast",), True, "mxfp4")
    assert variants and all(v.weights == "mxfp4" and v.name().endswith("_w4") for v in variants)
    assert "--weights mxfp4" in build_command(4096, 2048, 256, 6, 8, weights="mxfp4")
    assert "--weights" not in build_command(4096, 2048, 256, 6, 8)
    assert parser().parse_args(["--build", "--weights", "mxfp4"]).weights == "mxfp4"


def test_the_kernel_order_moves_only_sign_bits_within_words():
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (5, 64), dtype=torch.uint8, generator=gen)
    moved = to_kernel_codes(codes)
    assert torch.equal(from_kernel_codes(moved), codes)
    assert torch.equal(moved & 0x77, codes & 0x77)
    words = codes.view(torch.int32).view(-1, 1) >> torch.arange(32, dtype=torch.int32) & 1
    moved_words = moved.view(torch.int32).view(-1, 1) >> torch.arange(32, dtype=torch.int32) & 1
    assert torch.equal(words.sum(dim=1), moved_words.sum(dim=1))  # the same bits, moved within a word
    # Element 0's sign (bit 3 of the word) is bit 7 in the kernel's order; element 4's (bit 19) is bit 3.
    one = torch.tensor([0x08, 0, 0, 0], dtype=torch.uint8)
    assert to_kernel_codes(one).tolist() == [0x80, 0, 0, 0]
    assert to_kernel_codes(torch.tensor([0, 0, 0x08, 0], dtype=torch.uint8)).tolist() == [0x08, 0, 0, 0]


def _byte_perm(a: int, b: int, selector: int) -> int:
    """CUDA's __byte_perm (PRMT, default mode): byte i of the result is byte (nibble i & 7) of {b:a},
    or that byte's sign replicated where nibble i & 8."""
    source = a | b << 32
    result = 0
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = source >> 8 * (nibble & 7) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        result |= byte << 8 * i
    return result


def test_the_kernel_word_conversion_on_the_kernel_order_gives_the_folded_e4m3_bytes():
    """fp4_convert_word and fp4_e4m3_table_normal (csrc/megamoe/fp4_weights.cuh) written out on the
    codes transform_weights makes, folded by their 128-row block's largest scale: each row's k-block
    equals mxfp4.fold_blocks' e4m3 bytes. (The GPU
    suite checks the kernel itself.)"""
    gen = torch.Generator().manual_seed(11)
    rows = 128  # one block of w2 rows
    codes = torch.randint(0, 256, (rows, 64), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 132, (rows, 4), dtype=torch.uint8, generator=gen)  # spans <= 2^11: the normal table
    want = fold_blocks(codes, scales, gate_up=False)[0].view(torch.uint8)
    words = to_kernel_codes(codes).view(torch.int32).tolist()
    mask = 0xFFFFFFFF
    top = int(scales.max())
    for row in range(rows):
        got = []
        for w, word in enumerate(words[row]):
            word &= mask
            d = int(scales[row, w // 4]) - top + 6
            table = ((0x3C383000 + d * 0x08080800) & mask, (0x4C484440 + d * 0x08080808) & mask)
            magnitudes = word & 0x77777777
            low = _byte_perm(*table, magnitudes) | (word & 0x80808080)
            high_half = magnitudes * 0x10000 >> 32  # mul.hi.u32 by 2^16
            high = _byte_perm(*table, high_half) | ((word << 4) & 0x80808080)
            got += [low >> 8 * i & 0xFF for i in range(4)] + [high >> 8 * i & 0xFF for i in range(4)]
        assert got == want[row].tolist(), row


def test_each_scale_tile_ends_with_its_blocks_largest_codes_which_the_reference_folds_by():
    """transform_weights stores after each scale tile's k-block the largest code of its rows [0, 128)
    and [128, 256), the block a math warpgroup converts and folds by; mxfp4.fold_blocks (the
    FP8-tensor-core reference's fold) takes each row's scale from the same rows: for w13, 64 gate and
    64 up rows interleaved in runs of 8; for w2, 128 consecutive rows."""
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter = 2, 384, 384  # w2's last tile: rows [256, 384) and 128 padding rows
    w13, s13 = _mxfp4(gen, experts, 2 * inter, hidden)
    w2, s2 = _mxfp4(gen, experts, hidden, inter)
    (_, s13_t), (_, s2_t) = transform_weights((w13, s13), (w2, s2))
    for scales, kernel_scales, gate_up, rows in ((s13, s13_t, True, 2 * inter), (s2, s2_t, False, hidden)):
        tiles, record = kernel_scales[..., :256, :], kernel_scales[..., 256:, :].flatten(-2)
        assert record.shape[-1] == abi.kFp4BlockCodeBytes and not record[..., 2:].any()
        assert torch.equal(record[..., :2], tiles.unflatten(3, (2, 128)).amax(dim=(4, 5)))
        packed = torch.zeros(*scales.shape[:2], scales.shape[2] * MXFP4_GROUP // 2, dtype=torch.uint8)
        block_scale = fold_blocks(packed, scales, gate_up)[1]  # [E, N, K/128], each row its block's
        top = record[..., :2].permute(0, 1, 3, 2).flatten(1, 2).to(torch.int32)  # [E, N/128, K/128]
        want = torch.ldexp(torch.ones_like(top, dtype=torch.float32), top - 133)
        for row in range(rows):
            run, within = divmod(row, 16)  # kernel row -> checkpoint row (weights.py docstring)
            source = (8 * run + within if within < 8 else inter + 8 * run + within - 8) if gate_up else row
            assert torch.equal(block_scale[:, source], want[:, row // 128]), row


def test_nan_scales_are_refused_by_name():
    """E8M0's NaN code cannot stay one group's in the kernel's fold (its whole 128-row block's scale
    would be NaN), so transform_weights refuses it."""
    gen = torch.Generator().manual_seed(6)
    w13, s13 = _mxfp4(gen, 1, 256, 128)
    w2, s2 = _mxfp4(gen, 1, 128, 128)
    s2[0, 7, 1] = 255
    with pytest.raises(ValueError, match=r"MXFP4 scales w2_scale hold the E8M0 NaN code"):
        transform_weights((w13, s13), (w2, s2))
