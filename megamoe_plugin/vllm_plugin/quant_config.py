"""`fp8` (and DeepSeek-V4's `deepseek_v4_fp8`) quantization configs registered over vLLM's.

Registered (lazily, see registration.py) under the name "fp8", so `--quantization fp8`
and checkpoints whose `quantization_config.quant_method` is "fp8" resolve to it. It is
vLLM's `Fp8Config` in every respect except one: a MoE layer (`RoutedExperts`) whose
`moe_backend` is "megamoe_sm90" gets `MegaMoEFp8MoEMethod`. Dense layers, attention
KV-cache scales and MoE layers of every other backend go to vLLM's methods unchanged.
`megamoe_deepseek_v4_config` does the same for DeepSeek-V4 checkpoints, whose routed experts are
FP8 blocks (expert_dtype "fp8") or MXFP4 (expert_dtype "fp4": `MegaMoEMxfp4MoEMethod`).
"""
from __future__ import annotations

from vllm.model_executor.layers.quantization.fp8 import Fp8Config

from . import BACKEND
from .compat import is_layer_skipped, routed_experts_class


class MegaMoEFp8Config(Fp8Config):
    """vLLM's Fp8Config plus the megamoe_sm90 MoE method."""

    _megamoe = True  # marks the class for registration.py's idempotence check

    def get_quant_method(self, layer, prefix: str):
        if _megamoe_layer(layer):
            from . import refusals
            from .moe_method import MegaMoEFp8MoEMethod

            if is_layer_skipped(self, prefix):
                refusals.check_layer_skipped(prefix)
            return MegaMoEFp8MoEMethod(self, layer)
        return super().get_quant_method(layer, prefix)


def _megamoe_layer(layer) -> bool:
    return isinstance(layer, routed_experts_class()) and getattr(layer.moe_config, "moe_backend", None) == BACKEND


def megamoe_deepseek_v4_config(base):
    """`base` (vLLM's DeepSeek-V4 config class, `deepseek_v4_fp8`) with the megamoe_sm90 MoE methods."""

    class MegaMoEDeepseekV4Config(base):
        """vLLM's DeepSeek-V4 FP8 config plus the megamoe_sm90 MoE methods: FP8 routed experts (expert_dtype
        "fp8") on the FP8 method, MXFP4 ones ("fp4") re-encoded as FP8 blocks."""

        _megamoe = True

        def get_quant_method(self, layer, prefix: str):
            if not _megamoe_layer(layer):
                return super().get_quant_method(layer, prefix)
            from . import refusals
            from .moe_method import MegaMoEFp8MoEMethod, MegaMoEMxfp4MoEMethod

            if is_layer_skipped(self, prefix):
                refusals.check_layer_skipped(prefix)
            if self.expert_dtype == "fp8":
                return MegaMoEFp8MoEMethod(self, layer)
            refusals.check_fp4_experts(self.moe_quant_algo)
            return MegaMoEMxfp4MoEMethod(self, layer)

    return MegaMoEDeepseekV4Config
