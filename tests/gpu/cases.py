"""Shapes the single-GPU kernel tests run, and a CPU-side precompile of their variants.

`python -m tests.gpu.cases` compiles every kernel variant the GPU tests will load, so
a GPU session spends its time running, not compiling (carry MEGAMOE_CACHE_DIR along).
"""
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    topk: int
    local_experts: int
    max_tokens: int

    def __str__(self):
        return f"H{self.hidden}-I{self.intermediate}-K{self.topk}-E{self.local_experts}-N{self.max_tokens}"


# Covers H in {2048, 4096, 7168} plus an odd multiple of 128, I in {768, 1408, 1536,
# 2048, 3072}, K in {1, 2, 6, 8}, local experts in {1, 8, 32, 128}.
SHAPES = [
    Shape(2048, 768, 8, 32, 512),
    Shape(4096, 1536, 8, 8, 300),
    Shape(7168, 2048, 8, 32, 256),
    Shape(4096, 2048, 6, 32, 200),
    Shape(2048, 1408, 2, 128, 256),
    Shape(7168, 3072, 1, 1, 64),
    Shape(4096, 1408, 6, 8, 129),
    Shape(2048, 3072, 2, 8, 100),
    Shape(384, 256, 4, 4, 50),
    Shape(2048, 768, 8, 128, 256),  # also tests/gpu/test_vllm_shaped.py
]


# Shapes for the forced swap-AB tiers (tests/gpu/test_swap_tiers.py): H an odd multiple
# of 128, the e2e model's shape, and a large H with few tokens.
SWAP_TIERS = (8, 16, 32)
SWAP_SHAPES = [
    Shape(384, 256, 4, 4, 50),
    Shape(2048, 768, 8, 128, 64),
    Shape(7168, 2048, 8, 32, 24),
]


def call_variants(num_ranks, num_experts, topk, hidden, inter, max_tokens, num_sms, fast_maths=(True, False)):
    """Every variant a call with 0..max_tokens tokens per rank can select on an H200
    (ops.select_variant: the shipped table, else the heuristic)."""
    from megamoe_plugin.configs import lookup_config
    from megamoe_plugin.jit import KernelVariant

    configs = {lookup_config("NVIDIA H200", num_ranks, num_experts, topk, hidden, inter, n, num_sms)
               for n in range(max_tokens + 1)}
    return [KernelVariant(hidden, inter, topk, num_experts, num_ranks, cfg.block_m, cfg.num_stages, fast_math)
            for cfg in sorted(configs, key=lambda c: c.block_m) for fast_math in fast_maths]


def variants():
    from megamoe_plugin.heuristics import default_num_stages
    from megamoe_plugin.jit import KernelVariant

    from .multi_rank import MULTI_RANK_SHAPES

    out = []
    for hidden, inter, topk, local_experts, max_tokens, _ in MULTI_RANK_SHAPES:
        for num_ranks in (2, 4):
            out += call_variants(num_ranks, local_experts * num_ranks, topk, hidden, inter, max_tokens,
                                 132 // num_ranks, (True,))
    # benchmarks/bench_kernel.py under torchrun on two GPUs (32 local experts per rank).
    for hidden, inter, topk in ((7168, 2048, 8), (4096, 2048, 6)):
        out += call_variants(2, 64, topk, hidden, inter, 8192, 132, (True,))
    for s in SWAP_SHAPES:
        for block_m in SWAP_TIERS:
            for fast_math in (True, False):
                stages = default_num_stages(block_m, s.local_experts, s.hidden, s.intermediate)
                out.append(KernelVariant(s.hidden, s.intermediate, s.topk, s.local_experts, 1, block_m, stages,
                                         fast_math))
    for s in SHAPES:
        out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132)
    out += call_variants(2, 8, 2, 384, 256, 16, 132 // 2, (True,))  # tests/gpu/test_timeout.py
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    from megamoe_plugin.jit import check_variants

    sys.exit(1 if check_variants(variants()) else 0)
