"""FP8 e4m3 quantization helpers shared by the reference, the tests and the op layer.

These are the exact formulas of docs/design.md section 2, written once so that every piece
of the project that quantizes (activation staging, the reference's requant step, test
data generation) rounds the same way:

- per-token-group (activations): one float32 scale per row per `group_size` columns,
  s = max(amax(|group|), SCALE_EPS) / FP8_MAX, q = fp8(clamp(x / s, -FP8_MAX, FP8_MAX)).
  This is vLLM's dynamic per-token-group quantization (group 128) and also the
  kernel's requant of the SwiGLU output (group G, 128 or 64).
- 128x128 blocks (weights): one float32 scale per block of a [..., N, K] matrix, the
  layout of vLLM's FP8 block-quantized checkpoints (`weight_scale_inv`).

All arithmetic is float32 whatever the input dtype. The clamp before the cast makes the
saturation at +-448 explicit instead of relying on the cast's overflow behaviour, which
has differed across torch versions (NaN vs. saturate). The eps keeps all-zero groups
(padding rows, tokens whose activations vanish) at a finite scale with zero codes
instead of 0/0.
Functions accept any leading batch dims and run on whatever device the input is on.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_EPS = 1e-10


def _check_divisible(tensor: torch.Tensor, name: str, dim: int, divisor: int, divisor_name: str) -> None:
    if tensor.dim() < -dim:
        raise ValueError(f"{name} must have at least {-dim} dims, got shape {tuple(tensor.shape)}")
    if not isinstance(divisor, int) or isinstance(divisor, bool) or divisor <= 0:
        raise ValueError(f"{divisor_name} must be a positive int, got {divisor!r}")
    if tensor.shape[dim] % divisor != 0:
        raise ValueError(
            f"{name}.shape[{dim}]={tensor.shape[dim]} is not divisible by {divisor_name}={divisor} "
            f"({name} has shape {tuple(tensor.shape)})"
        )


def _check_dtype(tensor: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")


_QUANTIZABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_float_input(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _QUANTIZABLE_DTYPES:
        raise ValueError(f"{name} must be one of {_QUANTIZABLE_DTYPES}, got {tensor.dtype}")


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a tensor, not a Python float: on CUDA torch computes `t / float` as
    # `t * (1 / float)`, which is not the IEEE quotient of the contract (and of the kernel).
    return amax.clamp_min(SCALE_EPS) / torch.full((), FP8_MAX, device=amax.device)


def _cast_scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(clamp(x / scale)): division, not multiplication by 1/scale, as vLLM does."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _quantize_groups(x: torch.Tensor, group_size: int, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_float_input(x, name)
    _check_divisible(x, name, -1, group_size, "group_size")
    grouped = x.float().unflatten(-1, (x.shape[-1] // group_size, group_size))
    scale = _scale_from_amax(grouped.abs().amax(dim=-1, keepdim=True))
    q = _cast_scaled(grouped, scale)
    return q.flatten(-2), scale.squeeze(-1)


def quantize_per_token_group(x: torch.Tensor, group_size: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token-group FP8 quantization.

    x [..., H] (any float dtype) -> (q float8_e4m3fn [..., H], s float32 [..., H / group_size]).
    """
    return _quantize_groups(x, group_size, "x")


def requantize_groups(act: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 4 of the contract: requantize the SwiGLU output per `group_size` columns.

    Same formula as `quantize_per_token_group` (the kernel's requant must agree with
    vLLM's activation quant bit for bit); `group_size` has no default because the kernel
    picks G and the reference has to mirror it explicitly.
    """
    return _quantize_groups(act, group_size, "act")


def requant_tie_deltas(act: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group_size: int,
                       act_error: torch.Tensor) -> torch.Tensor:
    """Where per-group requantization (q, s of `act`) may round the other way, what that changes.

    act / s is rounded to the nearest e4m3 value. Where another evaluation of act, at most
    `act_error` (absolute, per element) away, may lie beyond the midpoint between q and the e4m3
    value on act's side of it, that evaluation rounds to the other value: a tie. Returns float64
    [..., N]: the dequantized change (other value - q) * s at each tie, 0 elsewhere.
    """
    _check_dtype(q, "q", FP8_DTYPE)
    scale = s.double().repeat_interleave(group_size, dim=-1)
    v = act.double() / scale
    q_value = q.double()
    codes = q.view(torch.uint8).long()
    # e4m3 magnitudes ascend with the code's low 7 bits: the neighbour on v's side of q is one
    # code up or down. v == q (no neighbour to tie with) and 448's upper side (nothing above) stay q.
    away = v.abs() > q_value.abs()
    magnitude = torch.where(away, (codes & 0x7F) + 1, (codes & 0x7F) - 1).clamp(0, 0x7E)
    sign = torch.where(v < 0, 0x80, 0)
    other = (sign | magnitude).to(torch.uint8).view(FP8_DTYPE).double()
    midpoint = (q_value + other) / 2
    tie = ((v - midpoint).abs() * scale <= act_error.double()) & (v != q_value) & (other != q_value)
    return torch.where(tie, (other - q_value) * scale, 0.0)


def dequantize_per_token_group(q: torch.Tensor, s: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """q [..., H] fp8, s [..., H / group_size] float32 -> float32 [..., H]."""
    _check_dtype(q, "q", FP8_DTYPE)
    _check_dtype(s, "s", torch.float32)
    _check_divisible(q, "q", -1, group_size, "group_size")
    expected = (*q.shape[:-1], q.shape[-1] // group_size)
    if tuple(s.shape) != expected:
        raise ValueError(f"s must have shape {expected} for q of shape {tuple(q.shape)} "
                         f"and group_size={group_size}, got {tuple(s.shape)}")
    grouped = q.float().unflatten(-1, (expected[-1], group_size))
    return grouped.mul_(s.unsqueeze(-1)).flatten(-2)  # in place: q.float() is a fresh copy


def _split_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., N, K] -> [..., N/block, block, K/block, block] view."""
    n, k = x.shape[-2:]
    return x.unflatten(-1, (k // block, block)).unflatten(-3, (n // block, block))


def quantize_weight_blocks(w: torch.Tensor, block: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """128x128 block FP8 quantization of weights.

    w [..., N, K] (any float dtype) -> (q float8_e4m3fn [..., N, K],
    s float32 [..., N / block, K / block]) with s = max(amax(|block|), SCALE_EPS) / FP8_MAX.
    """
    _check_float_input(w, "w")
    _check_divisible(w, "w", -2, block, "block")
    _check_divisible(w, "w", -1, block, "block")
    blocks = _split_blocks(w.float(), block)
    scale = _scale_from_amax(blocks.abs().amax(dim=(-3, -1), keepdim=True))
    q = _cast_scaled(blocks, scale)
    return q.flatten(-2).flatten(-3, -2), scale.squeeze(-1).squeeze(-2)


def dequantize_weight_blocks(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """q [..., N, K] fp8, s [..., N / block, K / block] float32 -> float32 [..., N, K]."""
    _check_dtype(q, "q", FP8_DTYPE)
    _check_dtype(s, "s", torch.float32)
    _check_divisible(q, "q", -2, block, "block")
    _check_divisible(q, "q", -1, block, "block")
    n, k = q.shape[-2:]
    expected = (*q.shape[:-2], n // block, k // block)
    if tuple(s.shape) != expected:
        raise ValueError(f"s must have shape {expected} for q of shape {tuple(q.shape)} "
                         f"and block={block}, got {tuple(s.shape)}")
    blocks = _split_blocks(q.float(), block)
    return blocks.mul_(s.unsqueeze(-1).unsqueeze(-3)).flatten(-2).flatten(-3, -2)  # in place: fresh copy
