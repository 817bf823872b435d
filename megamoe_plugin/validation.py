"""Every check of an fp8_mega_moe call before anything is launched (docs/design.md section 3):
the GPU, the buffer, y, the weights and the options, each refused with a message that names the
argument and the expectation."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import settings
from .buffer import check_open_buffer
from .heuristics import Numerics
from .weights import kernel_layout_shapes, unpack_pair, weight_format


def require_sm90(device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError(f"megamoe: fp8_mega_moe needs an SM90 (Hopper) GPU; the buffer is on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(f"megamoe: fp8_mega_moe needs an SM90 (Hopper: H100/H200/H20) GPU; {name} is "
                           f"sm_{major}{minor}")


def check_tensor(t, name: str, dtype: torch.dtype, shape: Tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def resolve_numerics(numerics: Optional[Numerics]) -> Numerics:
    """The call's numerics mode (docs/design.md section 2): the argument, else MEGAMOE_NUMERICS,
    else "fast"."""
    from .heuristics import check_numerics

    return check_numerics(numerics) if numerics is not None else settings.numerics()


def validate_call(y, l1, l2, buf, activation_clamp, fast_math, cumulative_local_expert_recv_stats,
                  config_num_tokens=None, staged_tokens=None) -> None:
    """Every check of a call, before anything is launched (docs/design.md section 3).
    `staged_tokens`: the rows staged for this call (SymmBuffer.take_staged_tokens), None if unknown."""
    check_open_buffer(buf)
    s, dev = buf.shape, buf.device
    el, h, i = s.num_local_experts, s.hidden, s.intermediate_size
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() != 2 or y.shape[1] != h:
        raise ValueError(f"y must have shape [num_tokens, hidden={h}], got {list(y.shape)}")
    if y.shape[0] > s.num_max_tokens_per_rank:
        raise ValueError(f"y has {y.shape[0]} tokens, more than the buffer's num_max_tokens_per_rank="
                         f"{s.num_max_tokens_per_rank}")
    check_tensor(y, "y", torch.bfloat16, (y.shape[0], h), dev)
    if staged_tokens is not None and y.shape[0] > staged_tokens:
        raise ValueError(f"y has {y.shape[0]} rows but {staged_tokens} tokens were staged for this call "
                         f"(stage_inputs / SymmBuffer.mark_staged): rows {staged_tokens} to {y.shape[0] - 1} would "
                         "run on stale inputs; pass y[:n] with the n that stage_inputs returned")
    w13, w13_scale = unpack_pair(l1, "l1")
    w2, w2_scale = unpack_pair(l2, "l2")
    shared = s.num_shared_experts
    if shared and isinstance(w13, torch.Tensor) and w13.dim() == 3 and w13.shape[0] == el - shared:
        raise ValueError(f"l1 holds {el - shared} experts, the routed ones only: the buffer has {shared} shared "
                         "expert(s), which the weights hold after the routed ones (transform_weights(..., shared=...))")
    # FP8, or MXFP4 (uint8 codes) read at 4 bits: the layouts transform_weights makes.
    layout = kernel_layout_shapes(weight_format(w13), el, h, i)
    for key, tensor, what in (("w13", w13, "l1 weight (w13)"), ("w13_scale", w13_scale, "l1 scale (w13_scale, transformed layout)"),
                              ("w2", w2, "l2 weight (w2)"), ("w2_scale", w2_scale, "l2 scale (w2_scale)")):
        shape, dtype, _ = layout[key]
        check_tensor(tensor, what, dtype, shape, dev)
    if activation_clamp is not None:
        if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, (int, float)):
            raise TypeError(f"activation_clamp must be a float or None, got {type(activation_clamp).__name__}")
        if not (math.isfinite(activation_clamp) and activation_clamp > 0):
            raise ValueError(f"activation_clamp must be a finite positive number, got {activation_clamp}")
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be a bool, got {type(fast_math).__name__}")
    if cumulative_local_expert_recv_stats is not None:
        check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", torch.int32, (el,), dev)
    if config_num_tokens is not None and (isinstance(config_num_tokens, bool) or not isinstance(config_num_tokens, int)
                                          or config_num_tokens < 0):
        raise ValueError(f"config_num_tokens must be a non-negative int or None, got {config_num_tokens!r}")
