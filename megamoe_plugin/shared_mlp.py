"""A framework's dense shared-expert MLP, run by the kernel as S shared experts.

vLLM and SGLang build a DeepSeek-family MoE layer's shared experts as one SwiGLU MLP of intermediate
n_shared * I with the same parts (their DeepseekV2MLP): `gate_up_proj` (S*I gate rows, then S*I up
rows), `act_fn` (SiluAndMul) and `down_proj`, each linear layer's `weight` and `weight_scale_inv` in
the checkpoint's 128x128-block FP8 layout. The kernel runs it as S experts of the routed I
(weights.split_mlp; docs/design.md section 2). What both plugins check about such an MLP and do with
it is here; each adds its framework's own conditions (vllm_plugin/shared_experts.py,
sglang_plugin/shared_experts.py).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .fp8 import FP8_DTYPE
from .weights import BLOCK, split_mlp


def block_fp8_matrix_problem(weight: Optional[torch.Tensor], scale: Optional[torch.Tensor], rows: int,
                             cols: int) -> Optional[str]:
    """Why (weight, scale) is not one [rows, cols] matrix of 128x128-block FP8 in the checkpoint
    layout, or None."""
    if (weight is None or scale is None or weight.dtype != FP8_DTYPE or tuple(weight.shape) != (rows, cols)
            or scale.dtype != torch.float32 or tuple(scale.shape) != (rows // BLOCK, cols // BLOCK)
            or not weight.is_contiguous() or not scale.is_contiguous()):
        return (f"its weights are not contiguous [{rows}, {cols}] float8_e4m3fn with [{rows // BLOCK}, "
                f"{cols // BLOCK}] float32 block scales")
    return None


def problem(mlp, hidden: int, intermediate: int,
            linear_problem: Optional[Callable[[object], Optional[str]]] = None) -> Optional[str]:
    """Why the kernel cannot run `mlp` as shared experts beside routed experts of hidden size `hidden`
    and intermediate size `intermediate`, or None. `linear_problem(linear)`: the framework's own
    reason against one of the MLP's linear layers, or None."""
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    act = type(getattr(mlp, "act_fn", None)).__name__
    if gate_up is None or down is None or act != "SiluAndMul":
        return f"{type(mlp).__name__} is not a gate_up_proj / SiluAndMul / down_proj MLP"
    for linear in (gate_up, down):
        if getattr(linear, "bias", None) is not None:
            return f"its {type(linear).__name__} has a bias"
        if getattr(linear, "tp_size", 1) != 1:
            return f"its {type(linear).__name__} is sharded over {linear.tp_size} tensor-parallel ranks"
        reason = linear_problem(linear) if linear_problem is not None else None
        if reason is not None:
            return reason
    rows = getattr(gate_up, "output_size_per_partition", None) or gate_up.weight.shape[0]
    shared_intermediate = rows // 2
    if rows % 2 or shared_intermediate % intermediate:
        return f"their intermediate size {shared_intermediate} is no multiple of the routed experts' {intermediate}"
    for linear, (r, c) in ((gate_up, (rows, hidden)), (down, (hidden, shared_intermediate))):
        reason = block_fp8_matrix_problem(getattr(linear, "weight", None), getattr(linear, "weight_scale_inv", None),
                                          r, c)
        if reason is not None:
            return reason
    return None


def num_experts(mlp, intermediate: int) -> int:
    """S: the experts of intermediate `intermediate` that `mlp` is (problem() returned None for it)."""
    return mlp.gate_up_proj.weight.shape[0] // (2 * intermediate)


def as_experts(mlp, intermediate: int) -> Dict[str, torch.Tensor]:
    """`mlp` as S experts in the checkpoint layout of transform_weights' `shared` (weights.split_mlp)."""
    return split_mlp(mlp.gate_up_proj.weight.data, mlp.gate_up_proj.weight_scale_inv.data,
                     mlp.down_proj.weight.data, mlp.down_proj.weight_scale_inv.data, intermediate)


def release(mlp) -> None:
    """The MLP's weights give their storage back (the kernel's copy is the only one)."""
    for param in mlp.parameters():
        param.data = param.data.new_empty(0)
