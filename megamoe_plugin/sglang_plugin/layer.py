"""The AROUND hooks on SGLang's SM90 mega-MoE path (`sglang.srt.layers.moe.mega_moe_sm90`,
`mega_moe`) and its model load. Each calls SGLang's original unless the server arguments select
megamoe_sm90, so DeepGEMM's `--moe-a2a-backend megamoe` keeps working with the plugin installed.

    build weights   (model load)  refusals, then `megamoe_plugin.transform_weights` in place
                                  of the parameters' data: no second copy of the experts
    load model      (after it)    the MoE blocks' shared experts into their calls where the
                                  kernel can take them (shared_experts.fold_model)
    available?      (forward)     our weights built (no DeepGEMM needed)
    buffer          (forward)     `megamoe_plugin.serving.get_buffer` over SGLang's MoE EP
                                  device group, sized by SGLang's per-rank token cap, with the
                                  shared experts the calls run
    routed forward  (forward)     staging + kernel (warmed up before its first call), or the
                                  float32 reference under MEGAMOE_EXECUTOR=reference
    block forward   (forward)     the routed call alone where it runs the shared experts, else
                                  the routed call first and the block's shared experts after it
                                  on a side stream (SGLang computes them first)

sglang 0.5.17 (HOOKS_0_5_17) hands the routed forward DeepSeek-V2's MoE block and asks for the
buffer without an MMA type; its adapters read the same facts off the block and call the same
code. It also leaves the mega-MoE path for the usual MoE forward when a batch is over the
token cap, which our weight layout cannot serve: that is refused instead.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .. import serving
from . import MEGA_MOE, MEGA_MOE_SM90, MODEL_RUNNER, WEIGHT_UPDATER, refusals, shared_experts
from .resolution import selected_by, token_cap

logger = logging.getLogger("megamoe_plugin.sglang")

MARK = "_megamoe_plugin_weights"  # set on a FusedMoE whose weights are in the kernel layout


def selected() -> bool:
    from sglang.srt.runtime_context import get_server_args

    try:
        return selected_by(get_server_args())
    except ValueError:  # no published server arguments in this process: nothing selected
        return False


def _device_sm() -> int:
    from sglang.srt.layers.moe import mega_moe_sm90

    return int(mega_moe_sm90._device_sm)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _check_unbuilt(experts) -> bool:
    """Whether the layer's weights are still to be built; if so, the layer is checked
    (refusals.check_experts), which raises where the kernel cannot take it."""
    if getattr(experts, "_mega_moe_weights_built", False):
        return False
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    refusals.check_experts(experts, executor=serving.get_executor(), device_sm=_device_sm(), device_name=name)
    return True


def build_weights(original, experts) -> None:
    if not selected():
        return original(experts)
    if _check_unbuilt(experts):
        import megamoe_plugin as mm

        _built(experts, *mm.transform_weights((experts.w13_weight.data, experts.w13_weight_scale_inv.data),
                                              (experts.w2_weight.data, experts.w2_weight_scale_inv.data)))
    return None


def build_mxfp4_weights(original, experts) -> None:
    """SGLang's build of MXFP4 experts (DeepSeek-V4's routed experts, which its FP8 method hands the
    mega-MoE path as packed E2M1 codes with their E8M0 scales staged as float32): the kernel's layout
    instead of SGLang's SM100 one. In fast numerics the kernel reads them at 4 bits; in exact
    numerics, which it does not run on MXFP4 weights, they become their exact FP8 128x128 blocks
    (mxfp4.to_fp8_blocks, which names a block that does not fit), read at FP8 bandwidth."""
    if not selected():
        return original(experts)
    if getattr(experts, "_mega_moe_w4a4", False) or getattr(experts, "_mega_moe_nvfp4", False):
        raise refusals.MegaMoEUnsupportedError(
            "FP4 activations (--enable-w4a4-mxfp4-megamoe) or NVFP4 experts: the kernel multiplies FP8 activations "
            "by FP8 or MXFP4 weights", "drop --enable-w4a4-mxfp4-megamoe, or serve FP8 or MXFP4 experts")
    if _check_unbuilt(experts):
        import megamoe_plugin as mm
        from megamoe_plugin.heuristics import kernel_weight_format
        from megamoe_plugin.mxfp4 import scale_bits_of_float, to_fp8_blocks
        from megamoe_plugin.validation import resolve_numerics

        pairs = [(getattr(experts, f"{stem}_weight").data.view(torch.uint8),
                  scale_bits_of_float(getattr(experts, f"{stem}_weight_scale_inv").data, f"{stem}_weight_scale_inv"))
                 for stem in ("w13", "w2")]
        if kernel_weight_format("mxfp4", resolve_numerics(None)) == "fp8":
            pairs = [to_fp8_blocks(codes, scales) for codes, scales in pairs]
        _built(experts, *mm.transform_weights(*pairs))
    return None


def _built(experts, l1, l2) -> None:
    """`experts` marked built for SGLang's SM90 path (is_sm90_fp8_mega_moe_available,
    is_mega_moe_experts_ready) and for the plugin, with kernel-layout weights l1, l2 installed."""
    experts._mega_moe_sm90_fp8_weights = True
    experts._mega_moe_weights_built = True
    setattr(experts, MARK, True)
    install_kernel_weights(experts, l1, l2)


def install_kernel_weights(experts, l1, l2) -> None:
    """`experts`' four parameters rebound to kernel-layout weights l1 = (w13, scale), l2 = (w2,
    scale): rebound, never copied, so the storages they held are released; SGLang's weight
    updates refused on them; the layer registered for the warm-up with them."""
    params = (experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight, experts.w2_weight_scale_inv)
    for param, data in zip(params, (*l1, *l2)):
        param.data = data
    experts.mega_l1_weights = (params[0].data, params[1].data)
    experts.mega_l2_weights = (params[2].data, params[3].data)
    refusals.refuse_weight_updates(params)
    serving.register_layer_weights(_warmup_key(experts), experts, experts.mega_l1_weights, experts.mega_l2_weights)


def load_model(original, runner):
    """After the model load (every weight built): the MoE blocks' shared experts into their calls
    where the kernel can take them (shared_experts.fold_model)."""
    result = original(runner)
    if selected():
        blocks = [module for module in runner.model.modules()
                  if getattr(getattr(module, "experts", None), MARK, False)
                  and getattr(module, "shared_experts", None) is not None]
        shared_experts.fold_model(blocks, token_cap(), install_kernel_weights)
    return result


def _warmup_key(experts) -> tuple:
    """What the layers that share a buffer have in common (their experts' kernel-layout shapes
    and device): the first forward of any of them builds the kernel params of all that are
    loaded (serving.maybe_warmup), so start-up reports one warm-up, not one per layer."""
    (w13, _), (w2, _) = experts.mega_l1_weights, experts.mega_l2_weights
    return ("sglang", str(w13.device), tuple(w13.shape), tuple(w2.shape))


def is_available(original, experts) -> bool:
    if not selected():
        return original(experts)
    return bool(getattr(experts, MARK, False))


def _ep_group(group) -> serving.EPGroup:
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return serving.EPGroup(1, 0)
    return serving.EPGroup(dist.get_world_size(group), dist.get_rank(group), group,
                           key=("sglang-ep", tuple(dist.get_process_group_ranks(group))))


def get_buffer(original, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
               num_shared_experts=0, *, mma_type, activation="swiglu"):
    if not selected():
        return original(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                        num_shared_experts, mma_type=mma_type, activation=activation)
    if num_shared_experts or activation != "swiglu" or mma_type != "fp8xfp4":
        # SGLang asks for these only on SM100 (FP4 activations or NVFP4 experts, fused shared
        # experts); "fp8xfp4" (FP8 activations) is what FP8 and MXFP4 experts both run here.
        raise refusals.MegaMoEUnsupportedError(
            f"a mega-MoE buffer with mma_type={mma_type!r}, activation={activation!r} and {num_shared_experts} "
            "fused shared experts: the kernel runs FP8 SwiGLU experts without shared experts",
            refusals.HINTS.pick_other)
    return _buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)


def get_buffer_0_5_17(original, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden):
    if not selected():
        return original(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
    return _buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)


def _buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden):
    """With the shared experts that the loaded model's calls of this routed shape run."""
    ep = group if serving.get_executor() == "kernel" else None
    return serving.get_buffer(_ep_group(ep), _device(), num_experts, num_max_tokens_per_rank, num_topk, hidden,
                              intermediate_hidden,
                              shared_experts.shared_experts_in_call(num_experts, hidden, intermediate_hidden))


def rank_equal_num_tokens(num_tokens: int) -> int:
    """The largest batch over the DP-attention ranks (SGLang gathers every rank's count on
    the CPU before the forward); without DP attention all EP ranks share one batch."""
    from sglang.srt.layers.dp_attention import get_dp_global_num_tokens

    counts = get_dp_global_num_tokens()
    return max([num_tokens] + [int(c) for c in counts]) if counts else num_tokens


def run_routed(original, experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, *, hidden_size,
               activation_clamp: Optional[float] = None, routed_scaling_factor: float = 1.0):
    if not selected():
        return original(experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, hidden_size=hidden_size,
                        activation_clamp=activation_clamp, routed_scaling_factor=routed_scaling_factor)
    return _run_routed(experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, hidden_size,
                       activation_clamp, routed_scaling_factor)


def _run_routed(experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, hidden_size,
                activation_clamp: Optional[float], routed_scaling_factor: float):
    hidden_states = hidden_states[:num_tokens].contiguous()
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    l1, l2 = experts.mega_l1_weights, experts.mega_l2_weights
    if buf.shape.num_shared_experts != shared_experts.num_in_call(experts):
        raise refusals.MegaMoEUnsupportedError(
            f"a MoE layer whose call runs {shared_experts.num_in_call(experts)} shared experts was handed a buffer "
            f"for {buf.shape.num_shared_experts}: its weights were built outside the model load the plugin wraps "
            "(ModelRunner.load_model)", "load the model through SGLang's ModelRunner")
    clamp = None if activation_clamp is None else float(activation_clamp)
    y = torch.empty((num_tokens, hidden_size), dtype=torch.bfloat16, device=hidden_states.device)
    if serving.get_executor() == "reference":
        serving.run_reference(y, hidden_states, topk_ids, topk_weights, l1, l2, buf, clamp)
        return y
    # Layers share a buffer; the first call on it compiles the variants and builds the kernel
    # params of every loaded layer (build_weights registered them): SGLang's eager warm-up
    # forward before CUDA-graph capture makes that call.
    serving.maybe_warmup(buf, _warmup_key(experts), l1, l2,
                         serving.warmup_token_counts(buf.shape.num_max_tokens_per_rank, ()))
    serving.run_kernel(y, hidden_states, topk_ids, topk_weights, l1, l2, buf, clamp,
                       rank_equal_num_tokens=rank_equal_num_tokens)
    return y


def run_routed_0_5_17(original, moe, hidden_states, topk_ids, topk_weights, buf, num_tokens):
    if not selected():
        return original(moe, hidden_states, topk_ids, topk_weights, buf, num_tokens)
    # What 0.5.17's own SM90 forward reads off the block.
    scaling = 1.0 if moe.experts.should_fuse_routed_scaling_factor_in_topk else float(moe.routed_scaling_factor)
    return _run_routed(moe.experts, hidden_states, topk_ids, topk_weights, buf, num_tokens, moe.config.hidden_size,
                       getattr(moe.config, "swiglu_limit", None), scaling)


def should_use_0_5_17(original, moe, hidden_states) -> bool:
    use = original(moe, hidden_states)
    if not use and selected() and getattr(moe.experts, MARK, False):
        raise refusals.MegaMoEUnsupportedError(
            f"a forward of {hidden_states.shape[0]} tokens on this rank (or more on another DP rank) is over "
            "the per-rank token cap, and sglang 0.5.17 would run the model's usual MoE forward, which cannot "
            "read the kernel's weight layout",
            "raise SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK or lower --cuda-graph-max-bs-decode / "
            "--max-running-requests / --chunked-prefill-size")
    return use


_shared_after_kernel = serving.SharedExpertsAfterKernel()


def forward_mega_moe(original, moe, hidden_states, forward_batch=None, input_ids_global=None):
    """SGLang's mega-MoE forward of a MoE block: the routed call alone where it runs the block's
    shared experts (shared_experts.fold_model), else the routed call launched first and the shared
    experts after it on a side stream (serving.SharedExpertsAfterKernel). SGLang's own order
    computes the shared experts first, and while capturing CUDA graphs puts the routed call on
    another stream: the shared experts' GEMMs then hold SMs the persistent kernel waits for. A block
    whose shared experts SGLang hands to the call (its SM100 path) keeps SGLang's forward."""
    if not selected() or getattr(moe, "mega_shared_l1_weights", None) is not None:
        return original(moe, hidden_states, forward_batch, input_ids_global)
    from sglang.srt.layers.moe import mega_moe

    num_tokens = hidden_states.shape[0]
    if shared_experts.num_in_call(moe.experts):
        return mega_moe._run_mega_routed(moe, hidden_states, forward_batch, input_ids_global, num_tokens)
    y, shared_output = _shared_after_kernel.run(
        lambda: mega_moe._run_mega_routed(moe, hidden_states, forward_batch, input_ids_global, num_tokens),
        lambda: moe._forward_shared_experts(hidden_states), hidden_states.is_cuda)
    if shared_output is not None:  # a block without shared experts
        y.add_(shared_output)
    return y


HOOKS = {
    MODEL_RUNNER + "load_model": load_model,
    MEGA_MOE + "build_mega_moe_experts_weights": build_mxfp4_weights,
    WEIGHT_UPDATER + "_model_load_weights_direct": refusals.load_weights_direct,
    MEGA_MOE_SM90 + "build_sm90_mega_moe_experts_weights": build_weights,
    MEGA_MOE_SM90 + "is_sm90_fp8_mega_moe_available": is_available,
    MEGA_MOE + "_get_mega_moe_symm_buffer": get_buffer,
    MEGA_MOE_SM90 + "run_sm90_mega_routed": run_routed,
    MEGA_MOE + "forward_mega_moe": forward_mega_moe,
}
HOOKS_0_5_17 = {
    MODEL_RUNNER + "load_model": load_model,
    WEIGHT_UPDATER + "_model_load_weights_direct": refusals.load_weights_direct,
    MEGA_MOE_SM90 + "build_sm90_mega_moe_experts_weights": build_weights,
    MEGA_MOE_SM90 + "is_sm90_fp8_mega_moe_available": is_available,
    MEGA_MOE + "_get_mega_moe_symm_buffer": get_buffer_0_5_17,
    MEGA_MOE_SM90 + "run_sm90_mega_routed": run_routed_0_5_17,
    MEGA_MOE + "should_use_mega_moe": should_use_0_5_17,
    MEGA_MOE + "forward_mega_moe": forward_mega_moe,
}
