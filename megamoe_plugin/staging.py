"""Stage one rank's MoE inputs into its symmetric buffer.

`stage_inputs(buf, hidden_states, topk_idx, topk_weights)` writes, for the first n tokens,
    buf.x[:n], buf.x_sf[:n]   per-token-group-128 FP8 quantization of hidden_states,
                              bit-identical to `megamoe_plugin.fp8.quantize_per_token_group`
    buf.topk_idx[:n]          topk_idx as int64
    buf.topk_weights[:n]      topk_weights as float32
and returns n, which it records on the buffer (SymmBuffer.mark_staged): the next call refuses
a y of more rows.

On CUDA this is ONE Triton kernel (grid: tokens x blocks of 128-column groups; the
first group block of each token also copies its top-k ids and weights). It reads the
sizes from the tensors' shapes only, so there is no host sync, no allocation and no
data-dependent control flow: the call is safe inside CUDA-graph capture once the kernel
is compiled (the first call compiles it; vLLM's profile run makes that call before
capture). n = 0 launches nothing.

On CPU the same math runs through `megamoe_plugin.fp8` (torch ops).

Triton is imported only on the CUDA path, so this module (and the package) imports
without it.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from .buffer import check_open_buffer
from .fp8 import FP8_MAX, SCALE_EPS, quantize_per_token_group

GROUP_SIZE = 128
# Groups of 128 columns each Triton program quantizes (4 x 128 = 512 columns).
_GROUPS_PER_PROGRAM = 4

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


def _check(buf, hidden_states, topk_idx, topk_weights) -> int:
    check_open_buffer(buf)
    for name, value in (("hidden_states", hidden_states), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    hidden, topk, max_tokens = buf.hidden, buf.num_topk, buf.num_max_tokens_per_rank
    device = buf.device

    if hidden_states.dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"hidden_states must be one of {_HIDDEN_DTYPES}, got {hidden_states.dtype}")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states must have shape [num_tokens, hidden={hidden}] (the buffer's hidden size), "
                         f"got {list(hidden_states.shape)}")
    if not _same_device(hidden_states.device, device):
        raise ValueError(f"hidden_states must be on the buffer's device {device}, got {hidden_states.device}")
    if not hidden_states.is_contiguous():
        raise ValueError("hidden_states must be contiguous (call .contiguous() first)")
    n = hidden_states.shape[0]
    if n > max_tokens:
        raise ValueError(f"hidden_states has {n} tokens, more than the buffer's num_max_tokens_per_rank={max_tokens}")

    if topk_idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if tuple(topk_idx.shape) != (n, topk):
        raise ValueError(f"topk_idx must have shape [num_tokens={n}, num_topk={topk}], got {list(topk_idx.shape)}")
    if not _same_device(topk_idx.device, device):
        raise ValueError(f"topk_idx must be on the buffer's device {device}, got {topk_idx.device}")

    if topk_weights.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"topk_weights must be a float tensor ({_WEIGHT_DTYPES}), got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (n, topk):
        raise ValueError(f"topk_weights must have shape [num_tokens={n}, num_topk={topk}], "
                         f"got {list(topk_weights.shape)}")
    if not _same_device(topk_weights.device, device):
        raise ValueError(f"topk_weights must be on the buffer's device {device}, got {topk_weights.device}")
    return n


def stage_inputs(buf, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 shared_scale: float = 1.0) -> int:
    """Quantize and copy one rank's inputs into `buf` (see the module docstring); returns n.

    hidden_states: bf16/fp16/fp32 [n, H], contiguous, on the buffer's device.
    topk_idx: int32/int64 [n, K]; -1 marks an empty slot. topk_weights: float [n, K].
    shared_scale: the routing weight of the buffer's shared experts (SymmBuffer.num_shared_experts),
    the model's scaling of their output; unused without them.
    Raises ValueError/TypeError naming the argument before writing anything.
    """
    n = _check(buf, hidden_states, topk_idx, topk_weights)
    if isinstance(shared_scale, bool) or not isinstance(shared_scale, (int, float)) or not math.isfinite(shared_scale):
        raise ValueError(f"shared_scale must be a finite number, got {shared_scale!r}")
    if n > 0 and buf.device.type == "cuda":
        buf.order_after_last_use()
        _stage_triton(buf, hidden_states, topk_idx, topk_weights, n, float(shared_scale))
    elif n > 0:
        _stage_torch(buf, hidden_states, topk_idx, topk_weights, n, float(shared_scale))
    buf.mark_staged(n)
    return n


def kernel_expert_ids(topk_idx: torch.Tensor, num_local_routed: int, num_shared: int) -> torch.Tensor:
    """Routed expert ids -> the kernel's numbering, where each rank's S shared experts follow its
    routed ones: e -> e + (e // E_l) * S. -1 stays -1; an id outside [-1, E) lands outside [-1, E + R S),
    where the kernel drops and counts it as it would have."""
    ids = topk_idx.long()
    return torch.where(ids == -1, ids, ids + torch.div(ids, num_local_routed, rounding_mode="floor") * num_shared)


def shared_expert_ids(rank: int, num_local_routed: int, num_shared: int) -> range:
    """The kernel's ids of rank `rank`'s shared experts (kernel_expert_ids)."""
    first = rank * (num_local_routed + num_shared) + num_local_routed
    return range(first, first + num_shared)


def _stage_torch(buf, hidden_states, topk_idx, topk_weights, n: int, shared_scale: float) -> None:
    q, s = quantize_per_token_group(hidden_states, GROUP_SIZE)
    buf.x[:n].copy_(q)
    buf.x_sf[:n].copy_(s)
    routed, shared = buf.num_topk, buf.num_shared_experts
    buf.topk_idx[:n, :routed].copy_(kernel_expert_ids(topk_idx, buf.num_local_experts, shared))
    buf.topk_weights[:n, :routed].copy_(topk_weights)
    for slot, expert in enumerate(shared_expert_ids(buf.rank, buf.num_local_experts, shared)):
        buf.topk_idx[:n, routed + slot] = expert
        buf.topk_weights[:n, routed + slot] = shared_scale


@functools.lru_cache(maxsize=None)
def _triton_kernel():
    """Build the Triton kernel on first use (imports triton only here)."""
    import triton
    import triton.language as tl

    if not hasattr(tl.math, "div_rn"):
        raise RuntimeError("megamoe staging needs triton.language.math.div_rn (IEEE division); upgrade Triton")

    @triton.jit
    def _stage_kernel(x_ptr, x_row_stride,
                      idx_ptr, idx_s0, idx_s1,
                      w_ptr, w_s0, w_s1,
                      q_ptr, sf_ptr, out_idx_ptr, out_w_ptr,
                      first_shared_id, shared_scale,
                      HIDDEN: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr,
                      GPB: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      LOCAL_ROUTED: tl.constexpr, SHARED: tl.constexpr, BLOCK_SHARED: tl.constexpr,
                      SCALE_MIN: tl.constexpr, QMAX: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        gb = tl.program_id(1)
        groups = gb * GPB + tl.arange(0, GPB)
        group_mask = groups < NUM_GROUPS
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = group_mask[:, None] & (cols >= 0)

        x = tl.load(x_ptr + t * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        # s = max(amax, eps) / 448, q = fp8(clamp(x / s)): IEEE divisions, as torch does.
        scale = tl.math.div_rn(tl.maximum(amax, SCALE_MIN), QMAX)
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(q_ptr + t * HIDDEN + cols, y.to(tl.float8e4nv), mask=mask)
        tl.store(sf_ptr + t * NUM_GROUPS + groups, scale, mask=group_mask)

        if gb == 0:
            # The routed slots (in the kernel's numbering, kernel_expert_ids), then the shared ones.
            k = tl.arange(0, BLOCK_K)
            k_mask = k < K
            ids = tl.load(idx_ptr + t * idx_s0 + k * idx_s1, mask=k_mask, other=-1).to(tl.int64)
            if SHARED > 0:
                rank_of = tl.where(ids >= 0, ids // LOCAL_ROUTED, -((-ids + LOCAL_ROUTED - 1) // LOCAL_ROUTED))
                ids = tl.where(ids == -1, ids, ids + rank_of * SHARED)
            tl.store(out_idx_ptr + t * (K + SHARED) + k, ids, mask=k_mask)
            w = tl.load(w_ptr + t * w_s0 + k * w_s1, mask=k_mask, other=0.0)
            tl.store(out_w_ptr + t * (K + SHARED) + k, w.to(tl.float32), mask=k_mask)
            if SHARED > 0:
                s = tl.arange(0, BLOCK_SHARED)
                s_mask = s < SHARED
                tl.store(out_idx_ptr + t * (K + SHARED) + K + s, (first_shared_id + s).to(tl.int64), mask=s_mask)
                tl.store(out_w_ptr + t * (K + SHARED) + K + s, tl.zeros([BLOCK_SHARED], tl.float32) + shared_scale,
                         mask=s_mask)

    return triton, _stage_kernel


def _stage_triton(buf, hidden_states, topk_idx, topk_weights, n: int, shared_scale: float) -> None:
    triton, kernel = _triton_kernel()
    hidden, topk, shared = buf.hidden, buf.num_topk, buf.num_shared_experts
    num_groups = hidden // GROUP_SIZE
    grid = (n, triton.cdiv(num_groups, _GROUPS_PER_PROGRAM))
    # (A CPU buffer: only Triton's interpreter, in the tests.)
    with torch.cuda.device(buf.device) if buf.device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](
            hidden_states, hidden_states.stride(0),
            topk_idx, topk_idx.stride(0), topk_idx.stride(1),
            topk_weights, topk_weights.stride(0), topk_weights.stride(1),
            buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights,
            shared_expert_ids(buf.rank, buf.num_local_experts, shared).start, shared_scale,
            HIDDEN=hidden, NUM_GROUPS=num_groups, GROUP=GROUP_SIZE, GPB=_GROUPS_PER_PROGRAM,
            K=topk, BLOCK_K=triton.next_power_of_2(topk),
            LOCAL_ROUTED=buf.num_local_experts, SHARED=shared, BLOCK_SHARED=triton.next_power_of_2(max(shared, 1)),
            SCALE_MIN=SCALE_EPS, QMAX=FP8_MAX,
            num_warps=4,
        )
