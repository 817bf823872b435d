"""A MoE layer's shared experts, run inside the kernel's call instead of beside it.

vLLM builds a DeepSeek-family layer's shared experts (DeepSeek-V2/V3, Kimi-K2, GLM-4.5) as one
dense MLP of intermediate size n_shared * I: gate_up_proj, SiLU-and-mul, down_proj, FP8 128x128
blocks like the routed experts. Its MoE runner runs that MLP beside the routed experts and adds:

    result = routed * routed_scaling_factor + shared

The kernel takes S shared experts of the routed I as S more local experts of every rank
(docs/design.md section 2): every token passes through them with one routing weight. So at load
the plugin splits the MLP into S = n_shared * I / I experts (exact: SwiGLU is per intermediate
channel, so the MLP is the sum of its channel slices' outputs), hands them to the kernel with the
routing weight 1 / routed_scaling_factor (the runner then scales the kernel's whole output), and
detaches the MLP from the runner, whose forward then has no shared experts to run. The MLP's own
weight storage is released: the kernel's copy is the only one.

A form the kernel cannot take stays with vLLM (the method runs it after the kernel on a side
stream, serving.SharedExpertsAfterKernel), with one log line per layer shape naming why:
a gated shared expert (Qwen2-MoE's sigmoid gate), a latent MoE's transforms, a clamped SwiGLU
(the kernel would clamp the shared experts too), TP-sharded or sequence-parallel shared experts,
weights not in the checkpoint's 128x128-block FP8 layout (a linear backend that repacks them:
Marlin, the CPU kernels), an intermediate size that is no multiple of the routed one, or more
slots per token than the kernel has.

This module reads vLLM internals (the runner's `_shared_experts`, the linear layers' kernel
object) that vLLM 0.24 and 0.33 share.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from ..buffer import BufferShape
from .. import shared_mlp
from .refusals import info_once, warn_once


# vLLM's block-FP8 linear kernels that keep the checkpoint layout: weight [N, K] float8_e4m3fn,
# weight_scale_inv [N/128, K/128] float32 (DeepGEMM may requantize both to power-of-two scales,
# which is still that layout and what vLLM itself computes with). The others repack the weight.
CHECKPOINT_LAYOUT_LINEAR_KERNELS = frozenset((
    "DeepGemmFp8BlockScaledMMKernel",
    "CutlassFp8BlockScaledMMKernel",
    "TritonFp8BlockScaledMMKernel",
    "FlashInferFp8BlockScaledMMKernel",
    "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
    "BlockWiseTorchFP8ScaledMMLinearKernel",
))


@dataclasses.dataclass
class KernelSharedExperts:
    """A layer's shared experts as the kernel takes them."""

    weights: Dict[str, torch.Tensor]  # transform_weights' `shared`: S experts, checkpoint layout
    num_experts: int  # S
    routing_weight: float  # stage_inputs' shared_scale


def _linear_kernel_problem(linear) -> Optional[str]:
    """Why vLLM's `linear` does not keep its weights in the checkpoint layout, or None."""
    kernel = type(getattr(getattr(linear, "quant_method", None), "fp8_linear", None)).__name__
    if kernel not in CHECKPOINT_LAYOUT_LINEAR_KERNELS:
        return (f"its weights are not 128x128-block FP8 in the checkpoint layout (linear kernel {kernel}; the kernel "
                f"takes them from {', '.join(sorted(CHECKPOINT_LAYOUT_LINEAR_KERNELS))})")
    return None


def _why_not(runner, mlp, moe_config, activation_clamp: Optional[float], hidden: int,
             intermediate: int, routed_format: str) -> Optional[str]:
    """Why the kernel cannot run this layer's shared experts, or None."""
    if routed_format != "fp8":
        return (f"the routed experts are {routed_format.upper()} read at 4 bits and the shared experts FP8 "
                "blocks: one call reads one weight format")
    if getattr(runner, "shared_expert_gate", None) is not None:
        return "they are gated (a sigmoid gate scales their output per token; the kernel has no such gate)"
    if getattr(runner, "routed_input_transform", None) is not None or \
            getattr(runner, "routed_output_transform", None) is not None:
        return "the routed experts run in a latent space the shared experts do not share"
    if activation_clamp is not None:
        return "the layer clamps the routed experts' SwiGLU (swiglu_limit), which the kernel would apply to them too"
    if getattr(moe_config, "is_sequence_parallel", False) or getattr(mlp, "is_sequence_parallel", False):
        return "the layer runs sequence parallel"
    return shared_mlp.problem(mlp, hidden, intermediate, _linear_kernel_problem)


def take_from_runner(runner, moe_config, activation_clamp: Optional[float], num_ranks: int, num_experts: int,
                     max_tokens: int, topk: int, hidden: int, intermediate: int,
                     routed_format: str = "fp8") -> Optional[KernelSharedExperts]:
    """The shared experts of the MoE runner `runner` for the kernel, detached from the runner and
    their MLP's storage released; None (the runner keeps them) where it has none or the kernel cannot
    take them (logged once per reason), e.g. beside routed experts of another weight format
    (`routed_format`, weights.weight_format)."""
    wrapper = getattr(runner, "_shared_experts", None)
    mlp = getattr(wrapper, "_layer", None)
    if mlp is None:
        return None
    reason = _why_not(runner, mlp, moe_config, activation_clamp, hidden, intermediate, routed_format)
    if reason is None:
        num_shared = shared_mlp.num_experts(mlp, intermediate)
        try:
            BufferShape.of_routed(num_ranks, num_experts, max(max_tokens, 1), topk, hidden, intermediate,
                                  num_shared_experts=num_shared)
        except ValueError as exc:
            reason = str(exc)
    if reason is not None:
        warn_once("megamoe_sm90: a MoE layer's shared experts (%s) run beside the kernel, not in its call: %s",
                  type(mlp).__name__, reason)
        return None
    weights = shared_mlp.as_experts(mlp, intermediate)
    scale = float(getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
    _detach(runner, mlp)
    info_once("megamoe_sm90: MoE layers' shared experts (%s of intermediate %d) run inside the kernel's call as %d "
              "more expert(s) per rank", type(mlp).__name__, num_shared * intermediate, num_shared)
    return KernelSharedExperts(weights, num_shared, 1.0 / scale)


def _detach(runner, mlp) -> None:
    """The runner forgets its shared experts (its forward entry is chosen again: the one without
    them), and the MLP's weights give their storage back."""
    runner._shared_experts = None
    runner._forward_entry = runner._select_forward()
    shared_mlp.release(mlp)
    for module in mlp.modules():
        # vLLM's DeepGEMM warm-up runs every linear layer that names a provider, with its weights
        if hasattr(module, "deep_gemm_warmup_provider"):
            del module.deep_gemm_warmup_provider
