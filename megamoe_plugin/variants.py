"""Which kernel variant a call runs: the shipped tuned table, else the heuristic, with
MEGAMOE_BLOCK_M / MEGAMOE_NUM_STAGES (settings) forcing the tier and depth (variant_for; ops.select_variant
memoizes it per call shape), and every variant a deployment's calls select
(deployment_variants: what `python -m megamoe_plugin.jit --build` pre-builds). One selection
for both, so a pre-built cache holds exactly what the calls load."""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Sequence

from .buffer import BufferShape
from .heuristics import NUMERICS_MODES, Numerics
from .kernel_variant import KernelVariant
from .model_config import MoEShape
from .settings import forced_block_m, forced_num_stages


def variant_for(s, device_name: str, grid_size: int, num_tokens: int, fast_math: bool, numerics: Numerics,
                forced_block_m: Optional[int] = None, forced_num_stages: Optional[int] = None,
                weights: str = "fp8") -> KernelVariant:
    """select_variant without a buffer or a GPU, for a buffer of shape `s` (buffer.BufferShape)
    on `grid_size` SMs of `device_name` (tests/gpu/cases.py precompiles with it), for expert weights
    of format `weights` (weights.weight_format): the GPU's table for that format, else the heuristic."""
    from .configs import lookup_config
    from .heuristics import (KernelConfig, check_weights_numerics, default_num_stages,
                             implemented_block_m, max_pipeline_stages, min_pipeline_stages, runnable_block_m)

    check_weights_numerics(weights, numerics)
    shape = (s.num_ranks, s.num_experts, s.num_topk, s.hidden, s.intermediate_size, num_tokens, grid_size)
    cfg = lookup_config(device_name, *shape, numerics=numerics, weights=weights)
    tiers = implemented_block_m(numerics, weights)
    if forced_block_m is not None and forced_block_m not in tiers:
        raise ValueError(f"MEGAMOE_BLOCK_M={forced_block_m} is not implemented in {numerics!r} numerics"
                         f"{' for MXFP4 weights' if weights == 'mxfp4' else ''} (tiers {tiers})")
    block_m = runnable_block_m(forced_block_m if forced_block_m is not None else cfg.block_m, fast_math)
    if block_m != cfg.block_m:
        stages = default_num_stages(block_m, s.num_local_experts, s.hidden, s.intermediate_size, numerics=numerics,
                                    weights=weights)
        cfg = KernelConfig(block_m=block_m, num_stages=stages, num_sms=cfg.num_sms)
    if forced_num_stages is not None:
        most = max_pipeline_stages(cfg.block_m, s.num_local_experts, numerics=numerics, weights=weights)
        if forced_num_stages > most:
            raise ValueError(f"forced num_stages={forced_num_stages} (MEGAMOE_NUM_STAGES) does not fit: at most {most} "
                             f"stages of block_m={cfg.block_m} fit in shared memory with {s.num_local_experts} local "
                             f"experts in {numerics} numerics")
        least = min_pipeline_stages(cfg.block_m, weights)
        if forced_num_stages < least:
            raise ValueError(f"forced num_stages={forced_num_stages} (MEGAMOE_NUM_STAGES) is too few: block_m={cfg.block_m} "
                             f"with {weights} weights needs at least {least} stages")
        cfg = dataclasses.replace(cfg, num_stages=forced_num_stages)
    return KernelVariant(s.hidden, s.intermediate_size, s.num_topk, s.num_experts, s.num_ranks, cfg.block_m,
                         cfg.num_stages, fast_math, numerics, windowed=s.windowed, weights=weights)


# The grid size given to the selection: it sets only the launch's CTA count, which is no
# template argument, so any value selects the same variants.
ANY_GRID_SIZE = 132


def deployment_variants(shape: MoEShape, ep_size: int, batch_sizes: Iterable[int], gpu: str,
                        numerics: Sequence[str] = NUMERICS_MODES, fast_math: bool = True,
                        weights: str = "fp8") -> List[KernelVariant]:
    """Every variant the calls of `shape` on `ep_size` ranks select on `gpu` at each batch
    size (tokens per rank), in each numerics mode, for experts of format `weights`
    (weights.weight_format); MEGAMOE_BLOCK_M and MEGAMOE_NUM_STAGES apply as at run time. The shape's shared experts count as the kernel's (BufferShape.of_routed:
    S more experts per rank, S more slots per token). Raises ValueError for a shape the kernel
    does not take."""
    counts = sorted(set(int(n) for n in batch_sizes))
    buffer_shape = BufferShape.of_routed(ep_size, shape.num_experts, max(counts[-1], 1), shape.num_topk, shape.hidden,
                                         shape.intermediate_size, num_shared_experts=shape.num_shared_experts)
    forced = (forced_block_m(), forced_num_stages())
    return list(dict.fromkeys(variant_for(buffer_shape, gpu, ANY_GRID_SIZE, n, fast_math, mode, *forced, weights)
                              for mode in numerics for n in counts))


def build_variants_for(shape: MoEShape, ep_size: int, batch_sizes: Iterable[int], gpu: str,
                       numerics: Sequence[str] = NUMERICS_MODES, fast_math: bool = True,
                       weights: str = "fp8") -> List[KernelVariant]:
    """What `jit --build` compiles for a model: deployment_variants, and for a model with shared
    experts those of its routed-only calls too. A framework runs the shared experts in the kernel's
    call where it hands them over (vLLM, DeepSeek-family layers), beside it otherwise (SGLang; forms
    the kernel cannot take), and the cache must serve either."""
    shapes = dict.fromkeys((shape, dataclasses.replace(shape, num_shared_experts=0)))
    return list(dict.fromkeys(variant for each in shapes
                              for variant in deployment_variants(each, ep_size, batch_sizes, gpu, numerics, fast_math,
                                                                 weights)))
