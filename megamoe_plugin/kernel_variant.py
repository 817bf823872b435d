"""One kernel variant: the template arguments of one compiled specialization of the fused kernel,
and the C++ source that instantiates it (its entry points' names and launch bounds). What the
compiler and cache (megamoe_plugin.jit) build and key by; what the op layer selects
(megamoe_plugin.variants) and launches."""
from __future__ import annotations

import dataclasses

from . import abi
from .buffer import window_loop
from .heuristics import DEFAULT_NUMERICS, Numerics, TIER_OF, check_weight_format, implemented_block_m

KERNEL_NAME = "megamoe_fused_kernel"
# Windowed variants' second entry (csrc/megamoe/kernel.cuh mega_moe_windows), launched after the first.
WINDOW_KERNEL_NAME = "megamoe_window_kernel"
NUM_THREADS = abi.kNumThreads


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """Template arguments of one compiled kernel."""

    hidden: int
    intermediate_size: int
    num_topk: int
    num_experts: int
    num_ranks: int
    block_m: int
    num_stages: int
    fast_math: bool
    numerics: Numerics = DEFAULT_NUMERICS
    # Debugging: per-tile clock records (csrc/megamoe/timeline.cuh, megamoe_plugin/timeline.py).
    timeline: bool = False
    # The buffer's pools hold fewer rows than the worst routing needs (buffer.BufferShape.windowed):
    # a call whose rows do not fit runs the rest in the window kernel (WINDOW_KERNEL_NAME).
    windowed: bool = False
    # The experts' weight format (weights.weight_format): "fp8" 128x128 block-scaled, or "mxfp4" (packed
    # E2M1 codes with E8M0 scales per 32, read at 4 bits; csrc/megamoe/fp4_weights.cuh).
    weights: str = "fp8"

    def __post_init__(self):
        if self.block_m not in implemented_block_m(self.numerics):
            raise ValueError(f"block_m={self.block_m} is not implemented in {self.numerics!r} numerics "
                             f"(tiers {implemented_block_m(self.numerics)})")
        if TIER_OF[self.block_m].rebalanced and not self.fast_math:
            raise ValueError(f"block_m={self.block_m} needs fast_math=True (heuristics.Tier.rebalanced)")
        check_weight_format(self.weights)
        if self.weights == "mxfp4" and self.block_m not in implemented_block_m(self.numerics, self.weights):
            raise ValueError(f"MXFP4 weights run block_m {implemented_block_m(self.numerics, self.weights)} in "
                             f"{self.numerics!r} numerics so far, not {self.block_m}")

    def source(self) -> str:
        cpp_bool = {True: "true", False: "false"}
        cfg = (f"megamoe::KernelConfig<{self.hidden}, {self.intermediate_size}, {self.num_topk}, {self.num_experts}, "
               f"{self.num_ranks}, {self.block_m}, {self.num_stages}, {cpp_bool[self.fast_math]}, "
               f"{cpp_bool[self.numerics == 'exact']}, {cpp_bool[self.windowed]}, "
               f"{cpp_bool[self.weights == 'mxfp4']}>")
        return (
            ("#define MEGAMOE_TIMELINE 1\n" if self.timeline else "")
            + '#include "megamoe/kernel.cuh"\n'
            f"using Cfg = {cfg};\n"
            f'extern "C" __global__ void __launch_bounds__(Cfg::kNumThreads, 1)\n'
            f"{KERNEL_NAME}(const __grid_constant__ megamoe::KernelParams p) {{ megamoe::mega_moe<Cfg>(p); }}\n"
            + (f'extern "C" __global__ void __launch_bounds__(Cfg::kNumThreads, 1)\n'
               f"{WINDOW_KERNEL_NAME}(const __grid_constant__ megamoe::KernelParams p) "
               f"{{ megamoe::mega_moe_windows<Cfg>(p); }}\n"
               f"static_assert(Cfg::kWindowLoop == {cpp_bool[window_loop(self.block_m)]}, "
               f"\"buffer.window_loop\");\n" if self.windowed else "")
        )

    def name(self) -> str:
        return (f"h{self.hidden}_i{self.intermediate_size}_k{self.num_topk}_e{self.num_experts}_r{self.num_ranks}"
                f"_bm{self.block_m}_st{self.num_stages}_fm{int(self.fast_math)}_{self.numerics}"
                + ("_win" if self.windowed else "") + ("_w4" if self.weights == "mxfp4" else "")
                + ("_timeline" if self.timeline else ""))
