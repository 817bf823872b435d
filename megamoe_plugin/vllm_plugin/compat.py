"""Differences between the vLLM versions the plugin supports (0.24 .. 0.33), detected by
feature rather than by version number. Only the vllm_plugin package imports vllm."""
from __future__ import annotations

import functools
import inspect


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


@functools.lru_cache(maxsize=None)
def routed_experts_class():
    """The module class that owns MoE expert weights and gets a quant method
    (`RoutedExperts` in 0.24..0.33; `FusedMoE` when it was still a class)."""
    import vllm.model_executor.layers.fused_moe as fused_moe

    cls = getattr(fused_moe, "RoutedExperts", None)
    if cls is None:
        cls = getattr(fused_moe, "FusedMoE")
    return cls


@functools.lru_cache(maxsize=None)
def fused_moe_factory():
    """Builds a MoE layer (router + experts + runner): `FusedMoEFactory` (0.33), `FusedMoE` (0.24)."""
    import vllm.model_executor.layers.fused_moe as fused_moe

    return getattr(fused_moe, "FusedMoEFactory", None) or getattr(fused_moe, "FusedMoE")


def is_layer_skipped(quant_config, prefix: str) -> bool:
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped as skipped

    kwargs = {}
    params = inspect.signature(skipped).parameters
    if "fused_mapping" in params:
        kwargs["fused_mapping"] = getattr(quant_config, "packed_modules_mapping", {})
    if "match_mode" in params and hasattr(quant_config, "ignored_layers_match_mode"):
        kwargs["match_mode"] = quant_config.ignored_layers_match_mode
    return bool(skipped(prefix=prefix, ignored_layers=quant_config.ignored_layers or [], **kwargs))


@functools.lru_cache(maxsize=None)
def prepare_finalize_base():
    """vLLM's pass-through prepare/finalize (0.33: selected by all2all_backend
    "passthrough") or, before it existed, the no-DP/EP one the plugin's pass-through
    subclass builds on."""
    try:
        from vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough import (
            PassThroughPrepareAndFinalize,
        )

        return PassThroughPrepareAndFinalize
    except ImportError:
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular,
        )

        return MoEPrepareAndFinalizeNoDPEPModular


def capture_sizes(vllm_config) -> list:
    comp = getattr(vllm_config, "compilation_config", None)
    sizes = getattr(comp, "cudagraph_capture_sizes", None) if comp is not None else None
    return list(sizes or [])


def max_num_batched_tokens(vllm_config, default: int) -> int:
    sched = getattr(vllm_config, "scheduler_config", None)
    value = getattr(sched, "max_num_batched_tokens", None) if sched is not None else None
    return int(value) if value else default


@functools.lru_cache(maxsize=None)
def shared_experts_in_method_order():
    """The shared-experts order in which the MoE method itself runs a layer's shared experts
    (0.33: SharedExpertsOrder.MK_INTERNAL_OVERLAPPED, chosen where the method says it can overlap
    them), or None where vLLM has no such order."""
    try:
        from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder
    except ImportError:
        return None
    return getattr(SharedExpertsOrder, "MK_INTERNAL_OVERLAPPED", None)
