"""MXFP4 (OCP microscaling FP4) expert weights: the exact dequantization of docs/design.md section 2
("FP4 experts"), and a quantizer that makes such weights for tests and benchmarks.

A weight matrix [..., N, K] is stored as
    packed uint8 [..., N, K/2]: two E2M1 codes per byte, element 2j in the low nibble and element
                 2j+1 in the high one (the order of the checkpoints and of vLLM's MXFP4 MoE layers);
    scale  E8M0 [..., N, K/32]: one power of two 2^(bits - 127) per 32 consecutive elements along K,
                 as torch.float8_e8m0fnu or as uint8 holding the same bits.
An E2M1 code is a sign bit and three magnitude bits: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Every value and
product here is exact in float32 (a code times a power of two), so the dequantization is exact.
"""
from __future__ import annotations

from typing import Tuple

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Elements per E8M0 scale, along the input dimension.
MXFP4_GROUP = 32
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
# E8M0's all-ones code is NaN (OCP MX); a checkpoint never stores it.
_E8M0_NAN = 255
_E8M0_BIAS = 127


def _codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K]: the low nibble of byte j is element 2j, the high one 2j+1."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed E2M1 codes must be a torch.uint8 tensor, got "
                         f"{packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__}")
    pairs = torch.stack([_codes_to_float(packed & 0x0F), _codes_to_float(packed >> 4)], dim=-1)
    return pairs.flatten(-2)


def scale_bits(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """The E8M0 codes of `scale` (torch.float8_e8m0fnu, or uint8 holding its bits) as uint8."""
    if not isinstance(scale, torch.Tensor) or scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name} must be E8M0 scales: torch.float8_e8m0fnu, or torch.uint8 holding their bits; "
                         f"got {scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale


def scale_to_float(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """E8M0 scales -> float32 2^(bits - 127) (exact; the NaN code gives NaN)."""
    bits = scale_bits(scale, name).to(torch.int32)
    value = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - _E8M0_BIAS)
    return torch.where(bits == _E8M0_NAN, torch.full_like(value, float("nan")), value)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] and E8M0 [..., N, K/32] -> float32 [..., N, K], exactly."""
    values = unpack_e2m1(packed)
    scales = scale_to_float(scale)
    if tuple(scales.shape[:-1]) != tuple(values.shape[:-1]) or scales.shape[-1] * MXFP4_GROUP != values.shape[-1]:
        raise ValueError(f"MXFP4 scales of shape {tuple(scale.shape)} do not fit codes of shape {tuple(packed.shape)}: "
                         f"expected [..., N, K/{MXFP4_GROUP}] = {(*values.shape[:-1], values.shape[-1] // MXFP4_GROUP)}")
    return values * scales.repeat_interleave(MXFP4_GROUP, dim=-1)


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (packed uint8 [..., N, K/2], E8M0 torch.float8_e8m0fnu [..., N, K/32]).

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
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = (exponent + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale
