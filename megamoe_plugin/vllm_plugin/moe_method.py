"""The megamoe_sm90 MoE method, its modular-kernel experts, and the pass-through
prepare/finalize they run behind.

Shape of the integration (the one vLLM uses for its own self-dispatching MoE-EP
megakernels):

    MoERunner -> router (top-k, EPLB mapping and load recording)
              -> MegaMoEFp8MoEMethod.apply
                 -> mk.FusedMoEKernel(MegaMoEPrepareAndFinalize, MegaMoEExperts)
                    prepare:  nothing (BF16 hidden states and top-k pass through)
                    experts:  stage_inputs (one fused Triton kernel: FP8 quant + ids +
                              weights into the symmetric buffer) then fp8_mega_moe
                              (dispatch, both GEMMs, SwiGLU, combine in one launch)
                    finalize: nothing (the kernel already wrote the combined, weighted
                              rows of this rank's tokens; output_is_reduced() is True)

Weights keep the checkpoint layout through loading (w13_weight, w13_weight_scale_inv,
w2_weight, w2_weight_scale_inv: 128x128 block FP8, exactly vLLM's Fp8MoEMethod), and
`process_weights_after_loading` rebinds the parameters' data to the kernel layout
(`megamoe_plugin.transform_weights`): the checkpoint-layout tensors are released, no
second copy remains, and EPLB's in-place expert shuffles act on what the kernel reads.
"""
from __future__ import annotations

from typing import Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoeWeightScaleSupported
from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.utils import set_weight_attrs

from . import BACKEND, compat, executor, refusals, shared_experts

BLOCK = 128
WEIGHT_NAMES = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")


class MegaMoEPrepareAndFinalize(compat.prepare_finalize_base()):
    """Pass-through: the kernel dispatches, combines and reduces by itself."""

    def output_is_reduced(self) -> bool:
        return True

    def supports_deferred_moe_finalize(self) -> bool:
        return False

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant: bool = False):
        return a1, None, None, None, None


class LayerRuntime:
    """Per-layer facts the experts need at call time (sizes, EP group, executor), and the weights
    the kernel reads (set at load: the routed experts, then the shared ones where the kernel runs them)."""

    def __init__(self, moe_config, executor_name: str, max_tokens: int, capture_sizes, activation_clamp):
        par = moe_config.moe_parallel_config
        self.executor = executor_name
        self.group = executor.EPGroup.from_vllm(par) if executor_name == "kernel" else executor.EPGroup(1, 0)
        self.num_experts = moe_config.num_experts
        self.topk = moe_config.experts_per_token
        self.hidden = moe_config.hidden_dim
        self.intermediate = moe_config.intermediate_size_per_partition
        self.max_tokens = max_tokens
        self.warmup_counts = executor.warmup_token_counts(max_tokens, capture_sizes)
        self.activation_clamp = None if activation_clamp is None else float(activation_clamp)
        self.numerics = executor.vllm_numerics()
        self.l1 = self.l2 = None
        self.num_shared_experts, self.shared_scale = 0, 1.0

    def _shape(self):
        return (self.num_experts, self.max_tokens, self.topk, self.hidden, self.intermediate, self.num_shared_experts)

    def buffer(self, device: torch.device):
        return executor.get_buffer(self.group, device, *self._shape())

    def buffer_key(self, device: torch.device):
        return executor.buffer_key(self.group, device, self._shape())

    def set_weights(self, layer, l1, l2, shared: Optional[shared_experts.KernelSharedExperts]) -> None:
        """At load: the kernel-layout weights, with `shared`'s experts after the routed ones where
        the kernel runs them. The first forward's warm-up then builds this layer's kernel params too,
        whichever layer runs first."""
        self.l1, self.l2 = tuple(l1), tuple(l2)
        if shared is not None:
            self.num_shared_experts, self.shared_scale = shared.num_experts, shared.routing_weight
        if self.executor == "kernel":
            executor.register_layer_weights(self.buffer_key(self.l1[0].device), layer, self.l1, self.l2)

    def run(self, output: torch.Tensor, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> None:
        if not hidden_states.is_contiguous():
            hidden_states = hidden_states.contiguous()
        buf = self.buffer(hidden_states.device)
        if self.executor == "kernel":
            executor.maybe_warmup(buf, self.buffer_key(buf.device), self.l1, self.l2, self.warmup_counts,
                                  self.numerics)
            executor.run_kernel(output, hidden_states, topk_ids, topk_weights, self.l1, self.l2, buf,
                                self.activation_clamp, self.numerics, shared_scale=self.shared_scale)
        else:
            executor.run_reference(output, hidden_states, topk_ids, topk_weights, self.l1, self.l2, buf,
                                   self.activation_clamp, shared_scale=self.shared_scale)


class MegaMoEExperts(mk.FusedMoEExpertsModular):
    """Modular-kernel experts running the whole MegaMoE (dispatch..combine) in one call."""

    def __init__(self, moe_config, quant_config, runtime: LayerRuntime):
        super().__init__(moe_config, quant_config)
        self.runtime = runtime

    # --- what the kernel supports (consulted only if vLLM's oracle ever asks)

    @staticmethod
    def activation_format():
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return refusals.get_probe().device_capability() == (9, 0)

    @staticmethod
    def _supports_batch_invariance() -> bool:
        # Under VLLM_BATCH_INVARIANT=1 the layer runs numerics="exact" (executor.vllm_numerics),
        # whose rows are bitwise independent of the rest of the batch (tests/gpu/test_batch_invariance.py).
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8Dynamic128Sym,
            kFp8Static128BlockSym,
        )

        return weight_key == kFp8Static128BlockSym and activation_key in (None, kFp8Dynamic128Sym)

    @staticmethod
    def _supports_activation(activation) -> bool:
        return str(getattr(activation, "value", activation)).lower() == "silu"

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return not getattr(moe_parallel_config, "use_batched_activation_format", False)

    @staticmethod
    def supports_lora() -> bool:
        return False

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # BF16 in: the staging kernel quantizes straight into the symmetric buffer

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        """(E_local, M, N, K, top-k) from the layer's shape: MXFP4 weights in the kernel's tiles are
        5-D, which vLLM's default (read off 3-D weights) refuses."""
        rt = self.runtime
        return w1.shape[0], a1.size(0), 2 * rt.intermediate, a1.size(-1), topk_ids.size(1)

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (0,), (0,), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        # w1, w2 are the layer's parameters: the routed experts of the weights the runtime holds
        self.runtime.run(output, hidden_states, topk_ids, topk_weights)
        return None


def _register(layer, name: str, tensor: torch.Tensor, attrs: dict) -> None:
    """A checkpoint-layout parameter of the layer, with the attributes vLLM's weight loader reads."""
    param = torch.nn.Parameter(tensor, requires_grad=False)
    layer.register_parameter(name, param)
    set_weight_attrs(param, attrs)


def _block_scale_attrs(extra_weight_attrs: dict) -> dict:
    """A scale tensor's loader attributes: vLLM's loader narrows it to each shard as it does its weight."""
    return dict(extra_weight_attrs, quant_method=FusedMoeWeightScaleSupported.BLOCK.value)


class MegaMoEFp8MoEMethod(FusedMoEMethodBase):
    """128x128 block FP8 MoE on the MegaMoE kernel (see the module docstring)."""

    def __init__(self, quant_config, layer):
        super().__init__(layer.moe_config)
        refusals.check_kernel_attribute(self, built=False)
        self.quant_config = quant_config
        self._shared_after_kernel = executor.SharedExpertsAfterKernel()
        self.weight_block_size = [BLOCK, BLOCK]
        self.block_quant = True
        self.weight_scale_name = "weight_scale_inv"
        self.experts: Optional[MegaMoEExperts] = None

        vllm_config = get_current_vllm_config()
        # where the runner registers itself under the layer's name: process_weights_after_loading finds
        # the layer's shared experts there
        self._runners = vllm_config.compilation_config.static_forward_context
        self.executor_name = executor.get_executor()
        refusals.check_quantization(quant_config)
        refusals.check_layer(self.moe, layer, executor=self.executor_name)
        refusals.check_vllm_features(vllm_config)
        if self.executor_name == "kernel":
            refusals.check_device()
            group = executor.EPGroup.from_vllm(self.moe.moe_parallel_config)
            if group.world_size > 1:
                refusals.check_ep_topology(group.key)
        else:
            refusals.warn_once("megamoe_sm90: %s=reference: MoE layers run the float32 reference instead of the "
                               "GPU kernel (a test aid, slow)", executor.ENV_VAR)

        max_tokens = int(getattr(self.moe, "max_num_tokens", 0) or 0)
        max_tokens = max(max_tokens, compat.max_num_batched_tokens(vllm_config, max_tokens))
        sizes = compat.capture_sizes(vllm_config)
        max_tokens = max([max_tokens] + sizes)
        clamp = getattr(self.moe, "swiglu_limit", None)
        self.runtime = LayerRuntime(self.moe, self.executor_name, max_tokens, sizes, clamp)
        if self.executor_name == "kernel":
            rt = self.runtime
            refusals.check_kernels_loadable(rt.hidden, rt.intermediate, rt.num_experts, rt.topk, rt.group.world_size,
                                            max_tokens, rt.numerics, weights=self.kernel_weights)

    # ------------------------------------------------------------------ weights

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        """Checkpoint layout, exactly as vLLM's Fp8MoEMethod creates it for 128x128 blocks."""
        layer.num_experts = num_experts
        layer.orig_dtype = params_dtype
        layer.weight_block_size = list(self.weight_block_size)
        inter, hidden = intermediate_size_per_partition, hidden_size
        fp8 = torch.float8_e4m3fn
        scale_attrs = _block_scale_attrs(extra_weight_attrs)
        _register(layer, "w13_weight", torch.empty(num_experts, 2 * inter, hidden, dtype=fp8), extra_weight_attrs)
        _register(layer, "w2_weight", torch.empty(num_experts, hidden, inter, dtype=fp8), extra_weight_attrs)
        _register(layer, "w13_weight_scale_inv",
                  torch.ones(num_experts, 2 * (inter // BLOCK), hidden // BLOCK, dtype=torch.float32), scale_attrs)
        _register(layer, "w2_weight_scale_inv",
                  torch.ones(num_experts, hidden // BLOCK, inter // BLOCK, dtype=torch.float32), scale_attrs)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def process_weights_after_loading(self, layer) -> None:
        """Checkpoint layout -> kernel layout in place of the parameters' data, with the layer's shared
        experts where the kernel can run them (shared_experts.take_from_runner), then the kernel."""
        import megamoe_plugin as mm

        w13, s13 = layer.w13_weight, getattr(layer, f"w13_{self.weight_scale_name}")
        w2, s2 = layer.w2_weight, getattr(layer, f"w2_{self.weight_scale_name}")
        if s13.dim() == 3:  # checkpoint layout (a second call finds the kernel layout: 4-D or 5-D w13 scales)
            rt = self.runtime
            shared = shared_experts.take_from_runner(self._runners.get(layer.layer_name), self.moe,
                                                     rt.activation_clamp, rt.group.world_size, rt.num_experts,
                                                     rt.max_tokens, rt.topk, rt.hidden, rt.intermediate,
                                                     self.kernel_weights)
            l1, l2 = mm.transform_weights((w13.data, s13.data), (w2.data, s2.data),
                                          shared=None if shared is None else shared.weights)
            # Rebind, never copy: the old storages are released here; the parameters (and with them
            # EPLB's view of the experts) are the routed experts of what the kernel reads.
            routed = w13.shape[0]
            w13.data, s13.data = (t[:routed] for t in l1)
            w2.data, s2.data = (t[:routed] for t in l2)
            self.runtime.set_weights(layer, l1, l2, shared)
            if shared is not None and self.executor_name == "kernel":  # the call's variants are others now
                refusals.check_kernels_loadable(rt.hidden, rt.intermediate, rt.num_experts, rt.topk,
                                                rt.group.world_size, rt.max_tokens, rt.numerics, shared.num_experts)
        elif self.runtime.l1 is None:  # weights that were already in the kernel layout when loaded
            self.runtime.set_weights(layer, (w13.data, s13.data), (w2.data, s2.data), None)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.experts = MegaMoEExperts(self.moe, self.moe_quant_config, self.runtime)
        self.moe_kernel = mk.FusedMoEKernel(MegaMoEPrepareAndFinalize(), self.experts)
        refusals.check_kernel_attribute(self, built=True)

    # The format the kernel reads the experts in (weights.weight_format).
    kernel_weights = "fp8"

    def get_fused_moe_quant_config(self, layer):
        return fp8_w8a8_moe_quant_config(
            w1_scale=getattr(layer, f"w13_{self.weight_scale_name}"),
            w2_scale=getattr(layer, f"w2_{self.weight_scale_name}"),
            a1_scale=None,
            a2_scale=None,
            block_shape=list(self.weight_block_size),
        )

    @property
    def supports_eplb(self) -> bool:
        # The router maps logical to physical experts and records the load in
        # expert_load_view; the parameters are contiguous per expert, so EPLB's
        # rearrangement moves kernel-layout experts whole.
        return True

    @property
    def method_name(self) -> str:
        return f"MegaMoEFp8MoEMethod({BACKEND})"

    # ------------------------------------------------------------------ forward

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        """True where vLLM lets the method run the shared experts (compat.shared_experts_in_method_order):
        `apply` launches them after the kernel (serving.SharedExpertsAfterKernel). Left to vLLM, a shared-expert
        model's shared experts run at small batches on an auxiliary stream launched before the kernel,
        whose persistent grid then waits for SMs the GEMMs hold."""
        return compat.shared_experts_in_method_order() is not None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None, **kwargs):
        if self.moe_kernel is None or self.experts is None:
            raise RuntimeError(f"{BACKEND}: the MoE weights have not been processed (process_weights_after_loading "
                               "was not called)")
        order = compat.shared_experts_in_method_order()
        if shared_experts is None or order is None:
            # Elsewhere (EPLB, sequence parallelism: no overlap) vLLM ran them itself before the MoE.
            return self._routed(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        # vLLM's SharedExperts keeps their output for the runner; the call returns nothing
        out, _ = self._shared_after_kernel.run(lambda: self._routed(layer, x, topk_weights, topk_ids),
                                               lambda: shared_experts(shared_experts_input, order), x.is_cuda)
        return out

    def _routed(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if x.shape[0] == 0:
            # Every EP rank takes part in every step; vLLM's modular kernel skips the
            # experts for an empty batch, so call them directly.
            out = x.new_empty(x.shape)
            self.runtime.run(out, x, topk_ids, topk_weights)
            return out
        return self.moe_kernel.apply(
            x,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            activation=layer.activation,
            global_num_experts=layer.global_num_experts,
            expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )

    def apply_monolithic(self, *args, **kwargs):  # pragma: no cover - never selected
        raise NotImplementedError(f"{BACKEND} is a modular (pre-routed) MoE method")


class MegaMoEMxfp4MoEMethod(MegaMoEFp8MoEMethod):
    """MXFP4 experts (DeepSeek-V4-Flash's routed experts: E2M1 codes, one E8M0 scale per 32 input values)
    on the same kernel, loaded as vLLM's MXFP4 method lays them out. In fast numerics the kernel reads
    them at 4 bits (weights.transform_weights lays them out for it; the layer's shared experts, FP8,
    then run beside the call). In exact numerics (VLLM_BATCH_INVARIANT=1), which the kernel does not run
    on MXFP4 weights yet, they are re-encoded exactly as the FP8 128x128 blocks the kernel reads
    (megamoe_plugin.mxfp4.to_fp8_blocks, which names a block that does not fit) and run at FP8 bandwidth."""

    def __init__(self, quant_config, layer):
        super().__init__(quant_config, layer)
        self.weight_scale_name = "weight_scale" if self.kernel_weights == "mxfp4" else "weight_scale_inv"

    @property
    def kernel_weights(self) -> str:
        """MXFP4 where the kernel runs them in the layer's numerics mode, else their FP8 blocks."""
        from megamoe_plugin.heuristics import kernel_weight_format
        from megamoe_plugin.validation import resolve_numerics

        return kernel_weight_format("mxfp4", resolve_numerics(self.runtime.numerics))

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        """Checkpoint layout as vLLM's Mxfp4MoEMethod creates it: uint8 codes and uint8 E8M0 scales."""
        from megamoe_plugin.mxfp4 import MXFP4_GROUP

        layer.num_experts = num_experts
        layer.orig_dtype = params_dtype
        inter, hidden = intermediate_size_per_partition, hidden_size
        scale_attrs = _block_scale_attrs(extra_weight_attrs)
        for name, shape, attrs in (("w13_weight", (num_experts, 2 * inter, hidden // 2), extra_weight_attrs),
                                   ("w13_weight_scale", (num_experts, 2 * inter, hidden // MXFP4_GROUP), scale_attrs),
                                   ("w2_weight", (num_experts, hidden, inter // 2), extra_weight_attrs),
                                   ("w2_weight_scale", (num_experts, hidden, inter // MXFP4_GROUP), scale_attrs)):
            _register(layer, name, torch.zeros(shape, dtype=torch.uint8), attrs)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def process_weights_after_loading(self, layer) -> None:
        """The FP8 method's kernel layout, of the MXFP4 weights (fast numerics) or of their exact FP8
        128x128 blocks (exact numerics)."""
        from megamoe_plugin.mxfp4 import to_fp8_blocks

        if self.kernel_weights == "fp8" and layer.w13_weight.dtype == torch.uint8:  # a second call finds FP8 weights
            for stem in ("w13", "w2"):
                weight = getattr(layer, f"{stem}_weight")
                codes, block_scales = to_fp8_blocks(weight.data, getattr(layer, f"{stem}_weight_scale").data)
                weight.data = codes
                delattr(layer, f"{stem}_weight_scale")
                layer.register_parameter(f"{stem}_weight_scale_inv",
                                         torch.nn.Parameter(block_scales, requires_grad=False))
        super().process_weights_after_loading(layer)

    @property
    def method_name(self) -> str:
        return f"MegaMoEMxfp4MoEMethod({BACKEND})"
