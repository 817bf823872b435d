"""A MoE block's shared experts run inside the kernel's call on SGLang, instead of beside it.

SGLang's DeepSeek-family MoE block (DeepseekV2MoE: DeepSeek-V2/V3, Kimi-K2 and the others on its
mega-MoE path) holds its shared experts as one dense MLP of intermediate n_shared * I
(`shared_experts`: gate_up_proj, SiLU-and-mul, down_proj; replicated on every rank when the
mega-MoE path is on), and adds its output to the routed experts' (already scaled by
routed_scaling_factor). The kernel takes S shared experts of the routed I as S more local
experts of every rank (docs/design.md section 2), so at the end of the model load (the plugin
wraps `ModelRunner.load_model`; the weight build before it sees only the experts module) each
block's MLP is split into S experts (megamoe_plugin.shared_mlp), appended to the block's kernel-layout
experts (weights.append_experts) with routing weight 1, and its own weight storage is released.
The block's forward (layer.forward_mega_moe) then runs only the routed call, and the buffer is
asked for S shared experts (`shared_experts_in_call`).

The choice is per model and all or nothing: the layers of a routed shape share one buffer, which
either has S shared slots or none. A model with a block the kernel cannot take (a clamped SwiGLU,
a gated or tensor-parallel shared MLP, weights not 128x128-block FP8 in the checkpoint layout, an
intermediate size no multiple of the routed one, fused shared experts in the top-k) keeps every
block's shared experts beside the kernel (serving.SharedExpertsAfterKernel), with one log line
naming why.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..buffer import BufferShape
from .. import shared_mlp
from ..weights import append_experts, weight_format
from .refusals import MegaMoEUnsupportedError, refuse_weight_updates

logger = logging.getLogger("megamoe_plugin.sglang")

IN_CALL = "_megamoe_shared_experts_in_call"  # on an experts module: S, the shared experts its call runs

# (num_experts, hidden, intermediate) of a routed shape -> S of the models loaded in this process
_in_call: Dict[Tuple[int, int, int], int] = {}
_lock = threading.Lock()


def shape_key(num_experts: int, hidden: int, intermediate: int) -> Tuple[int, int, int]:
    return int(num_experts), int(hidden), int(intermediate)


def shared_experts_in_call(num_experts: int, hidden: int, intermediate: int) -> int:
    """S for the buffer of this routed shape: the shared experts its layers' calls run (0: none)."""
    with _lock:
        return _in_call.get(shape_key(num_experts, hidden, intermediate), 0)


def num_in_call(experts) -> int:
    """The shared experts this experts module's call runs (0: they run beside it, or there are none)."""
    return int(getattr(experts, IN_CALL, 0))


def _routed_shape(experts) -> Tuple[int, int, int]:
    return shape_key(experts.num_experts, int(experts.hidden_size), int(experts.intermediate_size_per_partition))


def why_not(block, max_tokens: int) -> Optional[str]:
    """Why the kernel cannot run this MoE block's shared experts in its call, or None
    (`max_tokens`: the buffer's tokens per rank)."""
    experts, mlp = block.experts, block.shared_experts
    _, hidden, intermediate = _routed_shape(experts)
    if getattr(block, "num_fused_shared_experts", 0):
        return "SGLang routes them as fused shared experts in the top-k"
    if weight_format(experts.mega_l1_weights[0]) != "fp8":
        return "the routed experts are MXFP4 and the shared MLP FP8: one call reads one weight format"
    if getattr(experts.moe_runner_config, "swiglu_limit", None) is not None:
        return "the layer clamps the routed experts' SwiGLU (swiglu_limit), which the kernel would apply to them too"
    if getattr(mlp, "swiglu_limit", None) is not None:
        return "their SwiGLU is clamped (swiglu_limit)"
    reason = shared_mlp.problem(mlp, hidden, intermediate)
    if reason is not None:
        return reason
    try:
        BufferShape.of_routed(int(experts.moe_ep_size), int(experts.num_experts), max(max_tokens, 1),
                              int(block.config.num_experts_per_tok), hidden, intermediate,
                              num_shared_experts=shared_mlp.num_experts(mlp, intermediate))
    except ValueError as exc:
        return str(exc)
    return None


Install = Callable[[object, tuple, tuple], None]  # layer.install_kernel_weights(experts, l1, l2)


def fold(block, install: Install) -> None:
    """Move one block's shared experts into its experts' kernel-layout weights (`install`s them as
    the weight build does) and release the MLP's storage."""
    experts, mlp = block.experts, block.shared_experts
    _, _, intermediate = _routed_shape(experts)
    num = shared_mlp.num_experts(mlp, intermediate)
    install(experts, *append_experts(experts.mega_l1_weights, experts.mega_l2_weights,
                                     shared_mlp.as_experts(mlp, intermediate)))
    setattr(experts, IN_CALL, num)
    shared_mlp.release(mlp)
    refuse_weight_updates(mlp.parameters())


def fold_model(blocks: List, max_tokens: int, install: Install) -> None:
    """Run the shared experts of a model's MoE `blocks` (those whose experts hold the kernel layout
    and that have shared experts) in their calls, all or none; `install(experts, l1, l2)` gives a
    folded layer its new weights. Raises where a model loaded earlier in this process with
    the same routed shape chose otherwise (the two would share one buffer)."""
    if not blocks:
        return
    reasons: Dict[str, str] = {}
    for block in blocks:
        reason = why_not(block, max_tokens)
        if reason is not None:
            reasons.setdefault(reason, type(block.shared_experts).__name__)
    wanted: Dict[Tuple[int, int, int], int] = {}
    for block in blocks:
        shape = _routed_shape(block.experts)
        num = 0 if reasons else shared_mlp.num_experts(block.shared_experts, shape[2])
        if wanted.setdefault(shape, num) != num:
            reasons.setdefault(f"its layers of one routed shape have {wanted[shape]} and {num} shared experts",
                               type(block.shared_experts).__name__)
    if reasons:
        wanted = {shape: 0 for shape in wanted}
    with _lock:
        for shape, num in wanted.items():
            if _in_call.get(shape, num) != num:
                raise MegaMoEUnsupportedError(
                    f"this model runs {num} shared experts in the kernel's call and a model loaded earlier in this "
                    f"process with the same routed experts runs {_in_call[shape]}: the two would share one buffer",
                    "serve the two models in separate servers")
        _in_call.update(wanted)
        if reasons:
            for reason, name in reasons.items():
                logger.warning("megamoe_sm90: %d MoE layers' shared experts (%s) run beside the kernel, not in its "
                               "call: %s", len(blocks), name, reason)
            return
        for block in blocks:
            fold(block, install)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the routed experts' old storage, before SGLang measures free memory
    logger.info("megamoe_sm90: %d MoE layers run their shared experts (%s) inside the kernel's call as %s more "
                "expert(s) per rank", len(blocks), type(blocks[0].shared_experts).__name__,
                "/".join(str(n) for n in sorted(set(wanted.values()))))


def forget_models() -> None:
    """Forget the loaded models' choices (tests; a new engine in the same process)."""
    with _lock:
        _in_call.clear()
