"""`fp8` quantization config registered over vLLM's.

Registered (lazily, see registration.py) under the name "fp8", so `--quantization fp8`
and checkpoints whose `quantization_config.quant_method` is "fp8" resolve to it. It is
vLLM's `Fp8Config` in every respect except one: a MoE layer (`RoutedExperts`) whose
`moe_backend` is "megamoe_sm90" gets `MegaMoEFp8MoEMethod`. Dense layers, attention
KV-cache scales and MoE layers of every other backend go to vLLM's methods unchanged.
"""
from __future__ import annotations

from vllm.model_executor.layers.quantization.fp8 import Fp8Config

from . import BACKEND
from .compat import is_layer_skipped, routed_experts_class


class MegaMoEFp8Config(Fp8Config):
    """vLLM's Fp8Config plus the megamoe_sm90 MoE method."""

    _megamoe = True  # marks the class for registration.py's idempotence check

    def get_quant_method(self, layer, prefix: str):
        if isinstance(layer, routed_experts_class()) and getattr(layer.moe_config, "moe_backend", None) == BACKEND:
            from . import refusals
            from .moe_method import MegaMoEFp8MoEMethod

            if is_layer_skipped(self, prefix):
                refusals.check_layer_skipped(prefix)
            return MegaMoEFp8MoEMethod(self, layer)
        return super().get_quant_method(layer, prefix)
