"""Built-in launch heuristics for the fused MoE kernel: tile tier, pipeline depth, grid.

These functions decide a `KernelConfig` when no tuned table entry exists
(`configs.lookup_config` falls back to `default_config`), and give the tuning sweep
(`megamoe_plugin.tune`) its candidates. They are plain Python (no torch), so the op
layer, the JIT cache key and the table tooling can use them anywhere.

The shared-memory size of a variant is the kernel's own plan (csrc/megamoe/abi.h smem_plan, read
through megamoe_plugin.abi; smem.cuh's SharedStorage static_asserts that it lies as planned): one
persistent CTA per SM with a TMA pipeline whose stage holds an A tile (BLOCK_M x BLOCK_K fp8), a B
tile (BLOCK_N x BLOCK_K fp8) and the A rows' token scales, each stage padded to 1024 bytes, plus a
fixed part (mbarriers, the amax exchange, the expert tables, the epilogues' quad exchange lines,
and in exact numerics the FP16 token buffers).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Sequence, Tuple, get_args

from . import abi

# Tile shape fixed by the kernel (abi.h).
BLOCK_N = abi.kBlockN
BLOCK_K = abi.kBlockK


@dataclasses.dataclass(frozen=True)
class Tier:
    """One BLOCK_M tier of the kernel (csrc/megamoe/config.cuh): the one table the Python side
    asks what a tier is."""
    block_m: int
    # Two math warpgroups of 64 rows share each weight tile, in a register-rebalanced region where
    # a call out of line (fast_math=False's IEEE divisions call a slow path) makes ptxas spill: the
    # tier needs fast_math, and its window kernel runs one pool window per launch.
    rebalanced: bool
    # Exact numerics implements it (exact L1 on FP16 tensor cores has no rebalanced tier).
    exact: bool


TIERS = (Tier(8, False, True), Tier(16, False, True), Tier(32, False, True), Tier(64, False, True),
         Tier(128, True, False))
TIER_OF = {tier.block_m: tier for tier in TIERS}
# Every tier the kernel implements in some numerics mode. The heuristic picks from all of them (on an
# H200, v4flash and v3 with 32 local experts, each wins somewhere); a tuned table or MEGAMOE_BLOCK_M
# (ops.select_variant) may name any.
IMPLEMENTED_BLOCK_M = tuple(TIER_OF)
REBALANCED_BLOCK_M = next(tier.block_m for tier in TIERS if tier.rebalanced)
# (largest expected tokens per expert, preferred tier); above the last bound the largest tier.
# The bounds are where each tier wins on one H200 (docs/design.md section 9); the largest tier
# above 64 rows halves the weight traffic per token against 64.
_TIER_UPPER_BOUNDS = ((4.0, 8), (8.0, 16), (24.0, 32), (64.0, 64))

# docs/design.md section 2's two numerics modes: "fast" runs L1 on FP8 tensor cores (the default),
# "exact" on FP16 tensor cores over the exact FP8 values (csrc/megamoe/config.cuh kExactL1).
Numerics = Literal["fast", "exact"]
NUMERICS_MODES: Tuple[Numerics, ...] = get_args(Numerics)
DEFAULT_NUMERICS: Numerics = "fast"


def check_numerics(numerics) -> Numerics:
    if numerics not in NUMERICS_MODES:
        raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {numerics!r}")
    return numerics


# The experts' weight formats (weights.weight_format): FP8 128x128 blocks, or MXFP4 read at 4 bits
# (csrc/megamoe/config.cuh kFp4Weights), so far in fast numerics only.
WEIGHT_FORMATS = ("fp8", "mxfp4")
# What a shape's name gets for each weight format where the bench and the tuner name their configs.
WEIGHT_NAME_SUFFIX = {"fp8": "", "mxfp4": "+w4"}
_FP4_BLOCK_M = (8, 16, 32, 64, 128)


def check_weight_format(weights) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    return weights


def check_weights_numerics(weights: str, numerics: Numerics) -> None:
    """Refuses a weight format that the kernel does not run in this numerics mode (MXFP4 in exact)."""
    if not implemented_block_m(numerics, weights):
        raise ValueError(f"MXFP4 expert weights run in fast numerics only so far, not {numerics!r}")


def implemented_block_m(numerics: Numerics, weights: str = "fp8") -> tuple:
    """The tiers the kernel implements in this numerics mode for this weight format (none for MXFP4
    weights in exact numerics, so far)."""
    exact = check_numerics(numerics) == "exact"
    if check_weight_format(weights) == "mxfp4":
        return () if exact else _FP4_BLOCK_M
    return tuple(tier.block_m for tier in TIERS if tier.exact or not exact)


def kernel_weight_format(weights: str, numerics: Numerics) -> str:
    """The format the kernel reads experts stored as `weights` in, in `numerics` mode: their own where
    it implements tiers for it there, else FP8 (MXFP4 experts re-encoded as their exact 128x128
    blocks, mxfp4.to_fp8_blocks)."""
    return check_weight_format(weights) if implemented_block_m(numerics, weights) else "fp8"


def runnable_block_m(block_m: int, fast_math: bool) -> int:
    """The tier a call runs for a chosen `block_m`: fast_math=False calls run the largest tier
    without rebalancing instead of the register-rebalanced one (Tier.rebalanced)."""
    if TIER_OF[block_m].rebalanced and not fast_math:
        return max(tier.block_m for tier in TIERS if not tier.rebalanced)
    return block_m


# Opt-in dynamic shared memory per block on SM90 (227 KiB).
SMEM_LIMIT = abi.kSmemLimit

# Beyond this many stages the loads already in flight cover the memory latency.
MAX_STAGES = 8


def expected_tokens_per_expert(num_tokens: int, num_ranks: int, num_topk: int, num_experts: int) -> float:
    """Mean rows one expert receives: num_tokens * num_ranks * num_topk / num_experts.

    num_tokens is the per-rank token count. Every rank sends num_tokens * num_topk
    (token, slot) pairs spread over num_experts experts, so with balanced routing each
    expert, wherever it lives, receives this many rows. It is the GEMM M dimension per
    expert and hence what the tile tier and the table entries are keyed by.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    for name, value in (("num_ranks", num_ranks), ("num_topk", num_topk), ("num_experts", num_experts)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return num_tokens * num_ranks * num_topk / num_experts


def select_block_m(expected_tokens: float, supported: Optional[Sequence[int]] = None) -> int:
    """BLOCK_M tier for an expert that receives `expected_tokens` rows on average.

    Decode sends a handful of rows per expert: a 128-row tile would be mostly padding,
    wasting MMA work and A-tile bandwidth, so small tiles win there; prefill sends
    hundreds of rows and large tiles halve the B (weight) reloads per row. Preferred
    tier (_TIER_UPPER_BOUNDS): 8 up to 4 rows, 16 up to 8, 32 up to 24, 64 up to 64,
    128 above. When the preferred tier is
    not implemented (`supported`, default IMPLEMENTED_BLOCK_M) the nearest implemented
    one in log2 distance is used, the larger on a tie (fewer tiles, and the kernel
    pads rows anyway). The result never decreases as expected_tokens grows.
    """
    if expected_tokens < 0:
        raise ValueError(f"expected_tokens must be >= 0, got {expected_tokens}")
    tiers = IMPLEMENTED_BLOCK_M if supported is None else tuple(supported)
    unknown = sorted(set(tiers) - set(IMPLEMENTED_BLOCK_M))
    if not tiers or unknown:
        raise ValueError(f"supported BLOCK_M tiers must be a non-empty subset of {IMPLEMENTED_BLOCK_M}, got {tiers}")
    preferred = next((tier for bound, tier in _TIER_UPPER_BOUNDS if expected_tokens <= bound), IMPLEMENTED_BLOCK_M[-1])
    return min(tiers, key=lambda tier: (abs(math.log2(tier / preferred)), -tier))


def _check_tier(block_m: int) -> None:
    if block_m not in IMPLEMENTED_BLOCK_M:
        raise ValueError(f"block_m must be one of {IMPLEMENTED_BLOCK_M}, got {block_m}")


def _check_local_experts(num_local_experts: int) -> None:
    if num_local_experts < 1:
        raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")


def _smem_plan(block_m: int, num_stages: int, num_local_experts: int, numerics: Numerics, weights: str = "fp8") -> dict:
    return abi.smem_plan(block_m, num_stages, num_local_experts, check_numerics(numerics) == "exact",
                         check_weight_format(weights) == "mxfp4")


def smem_bytes(block_m: int, num_stages: int, num_local_experts: int, numerics: Numerics = DEFAULT_NUMERICS,
               weights: str = "fp8") -> int:
    """Dynamic shared memory one CTA is launched with, in bytes: the kernel's SharedStorage as abi.h
    plans it (num_stages pipeline stages and the fixed part) and the slack that aligns its base."""
    _check_tier(block_m)
    _check_local_experts(num_local_experts)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    return _smem_plan(block_m, num_stages, num_local_experts, numerics, weights)["bytes"] + abi.kSmemAlignSlack


def min_pipeline_stages(block_m: int, weights: str = "fp8") -> int:
    """The fewest stages a variant runs with (abi.h min_stages): MIN_STAGES, or 3 where the main loop
    converts MXFP4 weights of the next k-block while it holds the current one and the one before."""
    _check_tier(block_m)
    return _smem_plan(block_m, 0, 1, DEFAULT_NUMERICS, weights)["min_stages"]


# The fewest stages any variant runs with (two: the least that overlap a TMA load with the MMA on the
# previous one); some variants need more.
MIN_STAGES = min(min_pipeline_stages(block_m, weights) for block_m in IMPLEMENTED_BLOCK_M for weights in WEIGHT_FORMATS)


def max_pipeline_stages(block_m: int, num_local_experts: int, smem_limit: int = SMEM_LIMIT,
                        numerics: Numerics = DEFAULT_NUMERICS, weights: str = "fp8") -> int:
    """Largest stage count whose `smem_bytes` fits in `smem_limit`.

    Raises ValueError when fewer than min_pipeline_stages fit: with one stage the TMA producer
    and the math warpgroups would serialize, and the kernel would be far slower than
    any alternative, so that is refused rather than launched.
    """
    _check_tier(block_m)
    _check_local_experts(num_local_experts)
    without_stages = _smem_plan(block_m, 0, num_local_experts, numerics, weights)
    stages = (smem_limit - without_stages["bytes"] - abi.kSmemAlignSlack) // without_stages["stage"]
    if stages < without_stages["min_stages"]:
        raise ValueError(
            f"only {max(stages, 0)} pipeline stage(s) of block_m={block_m} fit in {smem_limit} bytes of shared "
            f"memory with {num_local_experts} local experts ({numerics} numerics, {weights} weights); the kernel "
            f"needs at least {without_stages['min_stages']}")
    return stages


def default_num_stages(block_m: int, num_local_experts: int, hidden: int, intermediate_size: int,
                       smem_limit: int = SMEM_LIMIT, numerics: Numerics = DEFAULT_NUMERICS,
                       weights: str = "fp8") -> int:
    """Pipeline depth: as many stages as fit, at most MAX_STAGES, at most the k-blocks
    of the shorter GEMM (min(hidden, intermediate_size) / BLOCK_K), never below min_pipeline_stages.

    Deeper pipelines keep more loads in flight, which is what the weight-bandwidth-bound
    decode case needs, but stages beyond the k-blocks one tile has cannot be filled by
    that tile's loads, and past MAX_STAGES the latency is already covered.
    """
    useful = max(min_pipeline_stages(block_m, weights), min(hidden, intermediate_size) // BLOCK_K)
    return min(max_pipeline_stages(block_m, num_local_experts, smem_limit, numerics, weights),
               stages_in_flight(weights), useful)


def stages_in_flight(weights: str = "fp8") -> int:
    """The deepest pipeline worth its shared memory for this weight format: MAX_STAGES of FP8 stages;
    an MXFP4 stage carries half the weight bytes, so twice the stages keep as many bytes in flight."""
    return 2 * MAX_STAGES if check_weight_format(weights) == "mxfp4" else MAX_STAGES


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel specialization; the kernel is compiled per config.

    num_sms is the number of persistent CTAs launched (one per SM the caller leaves
    free); the grid-wide barrier needs all of them resident at once.
    """

    block_m: int
    num_stages: int
    num_sms: int
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K

    def __post_init__(self) -> None:
        if self.block_m not in IMPLEMENTED_BLOCK_M:
            raise ValueError(f"block_m must be one of the implemented tiers {IMPLEMENTED_BLOCK_M}, got {self.block_m}")
        if (self.block_n, self.block_k) != (BLOCK_N, BLOCK_K):
            raise ValueError(f"the kernel's tile is block_n={BLOCK_N}, block_k={BLOCK_K}; "
                             f"got block_n={self.block_n}, block_k={self.block_k}")
        if self.num_stages < MIN_STAGES:
            raise ValueError(f"num_stages must be >= {MIN_STAGES}, got {self.num_stages}")
        if self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {self.num_sms}")

    def key(self) -> str:
        """Short file-name-safe identifier, e.g. 'bm64_st5_sm132'.

        block_n and block_k are validated to the kernel's fixed values, so the fields
        that can vary (block_m, num_stages, num_sms) identify the config.
        """
        return f"bm{self.block_m}_st{self.num_stages}_sm{self.num_sms}"


def default_config(num_ranks: int, num_experts: int, num_topk: int, hidden: int, intermediate_size: int,
                   num_tokens: int, num_sms: int, numerics: Numerics = DEFAULT_NUMERICS,
                   weights: str = "fp8") -> KernelConfig:
    """The heuristic config for a call with num_tokens tokens per rank on num_sms SMs, with expert
    weights of format `weights`."""
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})")
    for name, value in (("hidden", hidden), ("intermediate_size", intermediate_size)):
        if value < BLOCK_K or value % BLOCK_K != 0:
            raise ValueError(f"{name} must be a positive multiple of {BLOCK_K}, got {value}")
    expected = expected_tokens_per_expert(num_tokens, num_ranks, num_topk, num_experts)
    block_m = select_block_m(expected, implemented_block_m(numerics, weights))
    num_stages = default_num_stages(block_m, num_experts // num_ranks, hidden, intermediate_size, numerics=numerics,
                                    weights=weights)
    return KernelConfig(block_m=block_m, num_stages=num_stages, num_sms=num_sms)

