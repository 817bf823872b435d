"""MXFP4 (OCP microscaling FP4) expert weights: the exact dequantization of docs/design.md section 2
("FP4 experts"), and a quantizer that makes such weights for tests and benchmarks.

A weight matrix [..., N, K] is stored as
    packed uint8 [..., N, K/2]: two E2M1 codes per byte, element 2j in the low nibble and element
                 2j+1 in the high one (the order of the checkpoints and of vLLM's MXFP4 MoE layers);
    scale  E8M0 [..., N, K/32]: one power of two 2^(bits - 127) per 32 consecutive elements along K,
                 as torch.float8_e8m0fnu or as uint8 holding the same bits.
An E2M1 code is a sign bit and three magnitude bits: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Every value and
product here is exact in float32 (a code times a power of two), so the dequantization is exact.

`to_fp8_blocks` re-encodes such weights as the FP8 128x128 blocks the kernel reads today, exactly
where each block's scales allow it (its docstring says when): the kernel then runs them at the FP8
weights' bandwidth, not at 4 bits.
"""
from __future__ import annotations

from typing import Tuple

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Elements per E8M0 scale, along the input dimension.
MXFP4_GROUP = 32
# torch.float8_e8m0fnu exists from torch 2.7 on; the package imports on the older torch setup.py allows.
SCALE_DTYPES = tuple(dtype for dtype in (getattr(torch, "float8_e8m0fnu", None), torch.uint8) if dtype is not None)
# E8M0's all-ones code is NaN (OCP MX); a checkpoint never stores it.
_E8M0_NAN = 255
_E8M0_BIAS = 127


def _codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> the codes, uint8 [..., K]: the low nibble of byte j is element 2j, the high
    one 2j+1."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of _nibbles: codes uint8 [..., K] (each < 16) -> [..., K/2]."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K]: the low nibble of byte j is element 2j, the high one 2j+1."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed E2M1 codes must be a torch.uint8 tensor, got "
                         f"{packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__}")
    return _codes_to_float(_nibbles(packed))


# The kernel's order of the codes within each 32-bit word (8 elements; weights.py, transform_weights):
# nibble n holds element n's three magnitude bits and, in its top bit, the sign of element
# KERNEL_SIGN_OF_NIBBLE[n]. Elements 0-3's signs then sit at bits 7, 15, 23, 31, each at the top of
# its e4m3 byte, and 4-7's four bits lower, so the kernel sets the signs of a word's 8 e4m3 bytes by
# one mask and one shift (csrc/megamoe/fp4_weights.cuh, fp4_convert_word).
KERNEL_SIGN_OF_NIBBLE = (4, 0, 5, 1, 6, 2, 7, 3)
_NIBBLE_OF_SIGN = tuple(KERNEL_SIGN_OF_NIBBLE.index(element) for element in range(8))


def _move_signs(packed: torch.Tensor, source_of: Tuple[int, ...]) -> torch.Tensor:
    """Codes [..., K/2] (K a multiple of 8) with nibble n's sign bit taken from nibble source_of[n]
    of its 32-bit word, the magnitudes in place."""
    words = _nibbles(packed).reshape(*packed.shape[:-1], -1, 8)
    moved = (words & 0x7) | ((words >> 3)[..., list(source_of)] << 3)
    return _pack(moved.flatten(-2)).contiguous()


def to_kernel_codes(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint codes [..., K/2] -> the kernel's order (KERNEL_SIGN_OF_NIBBLE): a bit permutation
    within each 4-byte word."""
    return _move_signs(packed, KERNEL_SIGN_OF_NIBBLE)


def from_kernel_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of to_kernel_codes."""
    return _move_signs(codes, _NIBBLE_OF_SIGN)


def scale_bits(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """The E8M0 codes of `scale` (torch.float8_e8m0fnu, or uint8 holding its bits) as uint8."""
    if not isinstance(scale, torch.Tensor) or scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name} must be E8M0 scales: torch.float8_e8m0fnu, or torch.uint8 holding their bits; "
                         f"got {scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale


def check_no_nan_scales(scale: torch.Tensor, name: str = "MXFP4 scales") -> None:
    """Raises ValueError, naming `scale`, where it holds E8M0's NaN code (255). Neither an FP8 block
    nor the kernel's fold (per 128-row block, fold_blocks) can keep one group's NaN to that group."""
    if bool((scale_bits(scale, name) == _E8M0_NAN).any()):
        raise ValueError(f"{name} hold the E8M0 NaN code (255)")


def scale_bits_of_float(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """The E8M0 codes (uint8) of float32 scales that hold E8M0 values (powers of two 2^-127..2^127, or
    NaN), as SGLang stages MXFP4 experts' scales: exactly the float's exponent field. Anything else
    raises a ValueError naming `name`."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 here, got "
                         f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    bits = scale.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # 2^-127 is float32's subnormal 0x00400000 (exponent field 0, E8M0 code 0); NaN has field 255.
    exact = (bits >= 0) & (((exponent > 0) & (exponent < _E8M0_NAN) & (mantissa == 0)) | (bits == 0x00400000)
                           | (exponent == _E8M0_NAN) & (mantissa != 0))
    if not bool(exact.all()):
        bad = scale[~exact].flatten()[:3].tolist()
        raise ValueError(f"{name} must hold E8M0 values (powers of two 2^-127..2^127); it holds e.g. {bad}")
    return exponent.to(torch.uint8)


def scale_to_float(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """E8M0 scales -> float32 2^(bits - 127) (exact; the NaN code gives NaN)."""
    bits = scale_bits(scale, name).to(torch.int32)
    value = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - _E8M0_BIAS)
    return torch.where(bits == _E8M0_NAN, torch.full_like(value, float("nan")), value)


def _unpack(packed: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The codes' values float32 [..., N, K] and the scales' E8M0 codes int32 [..., N, K/32], checked
    to fit each other."""
    values, bits = unpack_e2m1(packed), scale_bits(scale).to(torch.int32)
    expected = (*values.shape[:-1], values.shape[-1] // MXFP4_GROUP)
    if tuple(bits.shape) != expected:
        raise ValueError(f"MXFP4 scales of shape {tuple(scale.shape)} do not fit codes of shape {tuple(packed.shape)}: "
                         f"expected [..., N, K/{MXFP4_GROUP}] = {expected}")
    return values, bits


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] and E8M0 [..., N, K/32] -> float32 [..., N, K], exactly."""
    values, _ = _unpack(packed, scale)
    return values * scale_to_float(scale).repeat_interleave(MXFP4_GROUP, dim=-1)


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (packed uint8 [..., N, K/2], E8M0 scales [..., N, K/32]: torch.float8_e8m0fnu,
    uint8 before torch 2.7).

    The OCP MX rule: each group's scale is 2^(floor(log2(amax)) - 2), so that the group's largest
    magnitude lands in [4, 8) before rounding (6 is E2M1's largest value: values past it saturate);
    each element rounds to the nearest E2M1 value, ties to the even code. An all-zero group gets
    the scale 2^-127.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError("w must be a floating-point torch.Tensor")
    if w.dim() < 1 or w.shape[-1] % MXFP4_GROUP != 0:
        raise ValueError(f"w's last dimension must be a multiple of {MXFP4_GROUP}, got shape {tuple(w.shape)}")
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))) - 2,
                           torch.full_like(amax, -_E8M0_BIAS)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    scaled = (groups / torch.ldexp(torch.ones_like(amax), exponent.int()).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    # The nearest magnitude; on a tie argmin gives the lower code, and an odd one moves up to the even.
    distance = (scaled.abs().unsqueeze(-1) - grid).abs()
    index = distance.argmin(dim=-1)
    tie_up = (distance.gather(-1, (index + 1).clamp(max=7).unsqueeze(-1)).squeeze(-1)
              == distance.gather(-1, index.unsqueeze(-1)).squeeze(-1)) & (index % 2 == 1) & (index < 7)
    codes = ((index + tie_up.long()) | torch.where(scaled < 0, 8, 0)).to(torch.uint8).flatten(-2)
    packed = _pack(codes)
    scale = (exponent + _E8M0_BIAS).to(torch.uint8)
    return packed, scale.view(SCALE_DTYPES[0])  # as uint8 bits where torch lacks float8_e8m0fnu


# A 128x128 block's one float32 scale is 2^(e - 6) for the largest exponent e of its groups that hold a
# nonzero code, so that the largest code, 6 x 2^6 = 384, stays within e4m3's 448. A group whose shift
# (its exponent minus the block's) lies in [-8, 6] has every code exact in e4m3 (subnormals included:
# 0.5 x 2^-8 = 2^-9, e4m3's least value): a block is exact when its groups' exponents span at most 14.
_FP8_BLOCK = 128
_TOP_SHIFT = 6


def to_fp8_blocks(packed: torch.Tensor, scale: torch.Tensor, exact: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [..., N, K/2] codes with E8M0 [..., N, K/32] scales -> (e4m3 [..., N, K], float32 block
    scales [..., N/128, K/128]): the weights' values as FP8 128x128 blocks (megamoe_plugin.fp8), each
    block's scale a power of two (the comment above says which).

    Exact wherever a block's nonzero groups' exponents span at most 14 (a scale ratio of 2^14 within
    128 rows x 128 columns), and wherever the far groups' codes happen to fit. Past that, small codes
    fall below e4m3's least value: with `exact` (the default) a ValueError names the first block that
    would change; without, those values round to nearest (ties to even) in e4m3.
    """
    values, bits = _unpack(packed, scale)
    n, k = values.shape[-2:]
    if n % _FP8_BLOCK or k % _FP8_BLOCK:
        raise ValueError(f"FP8 128x128 blocks need N and K multiples of {_FP8_BLOCK}; the codes of shape "
                         f"{tuple(packed.shape)} are [..., N={n}, K={k}]")
    check_no_nan_scales(scale)
    groups_per_block = _FP8_BLOCK // MXFP4_GROUP
    groups = values.unflatten(-1, (k // MXFP4_GROUP, MXFP4_GROUP))  # [..., N, K/32, 32]
    live = torch.where((groups != 0).any(dim=-1), bits, -1)  # a group of zeros takes any scale
    top = live.unflatten(-1, (k // _FP8_BLOCK, groups_per_block)).unflatten(-3, (n // _FP8_BLOCK, _FP8_BLOCK))
    top = top.amax(dim=(-3, -1))  # [..., N/128, K/128]; -1 where the block is all zeros
    block_exponent = torch.where(top >= 0, top - _E8M0_BIAS - _TOP_SHIFT, 0)
    shift = bits - _E8M0_BIAS - block_exponent.repeat_interleave(_FP8_BLOCK, -2).repeat_interleave(groups_per_block, -1)
    scaled = groups * torch.ldexp(torch.ones_like(shift, dtype=torch.float32), shift).unsqueeze(-1)
    e4m3 = scaled.flatten(-2).to(torch.float8_e4m3fn)
    if exact:
        changed = (e4m3.float() != scaled.flatten(-2)).unflatten(-1, (k // _FP8_BLOCK, _FP8_BLOCK))
        changed = changed.unflatten(-3, (n // _FP8_BLOCK, _FP8_BLOCK)).any(dim=(-3, -1)).nonzero()
        if len(changed):
            where = tuple(changed[0].tolist())
            raise ValueError(f"MXFP4 weights' 128x128 block {where} does not fit FP8 exactly: its scales span more "
                             f"than e4m3 holds beside its largest values (at most 2^14 always fits); pass "
                             f"exact=False to round its smallest values")
    return e4m3, torch.ldexp(torch.ones_like(block_exponent, dtype=torch.float32), block_exponent)


def fold_blocks(packed: torch.Tensor, scale: torch.Tensor, gate_up: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the kernel's FP8 tensor cores multiply for MXFP4 weights [..., N, K/2] (csrc/megamoe/
    fp4_weights.cuh): (e4m3 [..., N, K], float32 scales [..., N, K/128], each row its block's). The
    kernel folds per 128-row block of its layout and 128-wide k-block: with m the block's largest E8M0
    code there, the block's scale is 2^(m - 133) and group g's values are the codes times
    2^(s_g - m + 6), rounded to nearest even in e4m3: exact where the block's scales span at most
    2^14. The weight is then q x scale, per k-block.
    Its blocks: w2's 128 consecutive rows; with `gate_up` (w13: N/2 gate rows, then N/2 up rows),
    gate rows [64b, 64b + 64) with up rows [N/2 + 64b, N/2 + 64b + 64), as weights.transform_weights
    interleaves them."""
    values = unpack_e2m1(packed)
    bits = scale_bits(scale).to(torch.int32)
    *lead, rows, groups = bits.shape
    per_block = _FP8_BLOCK // MXFP4_GROUP
    k_blocks = groups // per_block
    by_block = bits.reshape(*lead, rows, k_blocks, per_block)
    row_top = by_block.amax(dim=-1)  # [..., N, K/128]
    if gate_up:
        halves = row_top.unflatten(-2, (2, rows // _FP8_BLOCK, _FP8_BLOCK // 2))
        top = halves.amax(dim=(-4, -2), keepdim=True).expand_as(halves).reshape(row_top.shape)
    else:
        blocks = row_top.unflatten(-2, (rows // _FP8_BLOCK, _FP8_BLOCK))
        top = blocks.amax(dim=-2, keepdim=True).expand_as(blocks).reshape(row_top.shape)
    shift = by_block - top.unsqueeze(-1) + _TOP_SHIFT
    shifted = values.reshape(*lead, rows, groups, MXFP4_GROUP) * torch.ldexp(
        torch.ones_like(shift, dtype=torch.float32), shift).reshape(*lead, rows, groups, 1)
    q = shifted.reshape(values.shape).to(torch.float8_e4m3fn)
    block_scale = torch.ldexp(torch.ones_like(top, dtype=torch.float32), top - _E8M0_BIAS - _TOP_SHIFT)
    return q, torch.where(top == _E8M0_NAN, torch.full_like(block_scale, float("nan")), block_scale)
