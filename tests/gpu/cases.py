"""Shapes the single-GPU kernel tests run, and a precompile of the variants a GPU run loads.

`python -m tests.gpu.cases` compiles every kernel variant the GPU tests, the sanitizer runs and the
benchmarks will load (nvcc only, no GPU needed), so that the GPU machine spends its time running,
not compiling: compile on a machine with nvcc, copy MEGAMOE_CACHE_DIR to the GPU machine. The variants
are those an H200 selects (132 SMs, configs/NVIDIA_H200.json); another GPU may still compile a few.
  --bench   only `python -m megamoe_plugin.bench --configs v3,v4flash`'s (both numerics);
  --lag     only tools/tile_timeline.py's runs of LAG_RUNS (where the pull ends and the scatter starts);
  --x2      only what a run on two GPUs loads (torchrun: tests.gpu.multi_rank, the R = 2 benchmark);
  --jobs    print the sanitizer runs, one job per line for tools/sanitizer_sweep.sh
            (tools/gpu_check.sh SANITIZER=1), optionally only --numerics M,... and --tiers B,...
"""
import argparse
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


# The e2e model's MoE layer (tools/e2e, python -m megamoe_plugin.bench.vs_vllm, tests/gpu/test_vllm_shaped.py):
# Qwen3-30B-A3B's experts, 128 on one GPU, top-8.
def _e2e_shape():
    from megamoe_plugin.configs import TableShape

    return TableShape(num_local_experts=128, hidden=2048, intermediate_size=768, num_topk=8)


# Shapes for the forced tiers (tests/gpu/test_forced_tiers.py): H an odd multiple
# of 128, the e2e model's shape, and a large H with few tokens.
def _forced_tiers():
    from megamoe_plugin.heuristics import NUMERICS_MODES, implemented_block_m

    return [(numerics, block_m) for numerics in NUMERICS_MODES for block_m in implemented_block_m(numerics)]


FORCED_TIERS = _forced_tiers()
# tests/gpu/test_mxfp4_weights_gpu.py: MXFP4 experts (fast numerics) on a small shape and on v4flash's,
# each tier forced on FORCED_TIER_SHAPES and on WINDOW_SHAPES[0]'s pools, and R = 2, 4 ranks side by
# side on tests/gpu/multi_rank.py's MULTI_RANK_SHAPES.
MXFP4_SHAPES = [Shape(384, 256, 4, 8, 64), Shape(4096, 2048, 6, 32, 128)]


def mxfp4_tiers():
    from megamoe_plugin.heuristics import implemented_block_m

    return implemented_block_m("fast", "mxfp4")
# tests/gpu/test_forced_tiers.py's grid of a few CTAs, where L1 tiles wait for rows other CTAs still pull.
SMALL_GRID_SMS = 4
# tests/gpu/test_pool_windows.py: pools of WINDOW_POOL_ROWS rows (one BLOCK_M 128 m-block), on one
# rank (an H an odd multiple of 128; a shape whose pull goes on during L1) and on R = 2, 4, 8 ranks.
WINDOW_POOL_ROWS = 128
WINDOW_SHAPES = [Shape(384, 256, 4, 4, 50), Shape(7168, 2048, 8, 32, 24)]
WINDOW_RANK_SHAPE = (2048, 768, 6, 4, 64)  # hidden, intermediate, topk, local experts, max tokens
FORCED_TIER_SHAPES = [
    Shape(384, 256, 4, 4, 50),
    Shape(2048, 768, 8, 128, 64),
    Shape(7168, 2048, 8, 32, 24),
]


# The GPU whose selection (its shipped table, else the heuristic) the variants follow: --gpu.
GPU_NAME = "NVIDIA H200"


def call_variants(num_ranks, num_experts, topk, hidden, inter, max_tokens, num_sms, fast_maths=(True, False),
                  forced_block_m=None, numerics_modes=None, pool_rows=None, num_shared_experts=0, weights="fp8"):
    """Every variant a call with 0..max_tokens tokens per rank can select on GPU_NAME, in both
    numerics modes (ops.select_variant: the shipped table, else the heuristic; MEGAMOE_BLOCK_M
    = forced_block_m), on a buffer with `pool_rows` and `num_shared_experts` beside the
    `num_experts` routed ones (BufferShape.of_routed), for expert weights of format `weights`
    (MXFP4: fast numerics only)."""
    from megamoe_plugin.buffer import BufferShape
    from megamoe_plugin.heuristics import NUMERICS_MODES
    from megamoe_plugin.variants import variant_for

    shape = BufferShape.of_routed(num_ranks, num_experts, max_tokens, topk, hidden, inter, pool_rows,
                                  num_shared_experts)
    return list(dict.fromkeys(
        variant_for(shape, GPU_NAME, num_sms, n, fast_math, numerics, forced_block_m, weights=weights)
        for n in range(max_tokens + 1) for fast_math in fast_maths for numerics in numerics_modes or NUMERICS_MODES))


def variants():
    from .multi_rank import MULTI_RANK_SHAPES
    from .test_wrap import SHAPE as WRAP_SHAPE

    out = []
    for hidden, inter, topk, local_experts, max_tokens, _ in MULTI_RANK_SHAPES:
        for num_ranks in (2, 4):
            out += call_variants(num_ranks, local_experts * num_ranks, topk, hidden, inter, max_tokens,
                                 132 // num_ranks, (True,))
    hidden, inter, topk, local_experts, max_tokens, _ = WRAP_SHAPE
    for num_ranks in (1, 2):
        out += call_variants(num_ranks, local_experts * num_ranks, topk, hidden, inter, max_tokens,
                             132 // num_ranks, (True,))
    # python -m megamoe_plugin.bench on one GPU (every reference shape, as `python -m megamoe_plugin.tune` and
    # megamoe_plugin.bench.vs_vllm's e2e layer) and under torchrun on two GPUs (v3, v4flash).
    from megamoe_plugin.configs import REFERENCE_SHAPES

    for ref in list(REFERENCE_SHAPES.values()) + [_e2e_shape()]:
        out += call_variants(1, ref.num_local_experts, ref.num_topk, ref.hidden, ref.intermediate_size, 8192, 132,
                             (True,))
    out += x2_variants()
    for s in FORCED_TIER_SHAPES:
        for numerics, block_m in FORCED_TIERS:
            out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132,
                                 forced_block_m=block_m, numerics_modes=(numerics,))
            out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens,
                                 SMALL_GRID_SMS, (True,), forced_block_m=block_m, numerics_modes=(numerics,))
    for s in SHAPES:
        out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132)
    for s in WINDOW_SHAPES:
        for numerics, block_m in FORCED_TIERS:
            out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132,
                                 forced_block_m=block_m, numerics_modes=(numerics,), pool_rows=WINDOW_POOL_ROWS)
    from megamoe_plugin.buffer import BufferShape

    hidden, inter, topk, local_experts, max_tokens = WINDOW_RANK_SHAPE
    for num_ranks in (2, 4, 8):
        for pool_rows in (WINDOW_POOL_ROWS, BufferShape(num_ranks, local_experts * num_ranks, max_tokens, topk, hidden,
                                                        inter).max_pool_rows, None):
            out += call_variants(num_ranks, local_experts * num_ranks, topk, hidden, inter, max_tokens,
                                 132 // num_ranks, (True,), pool_rows=pool_rows)
        if num_ranks < 8:  # the EP-width test's one rank with every expert
            out += call_variants(1, local_experts * num_ranks, topk, hidden, inter, max_tokens, 132, (True,),
                                 numerics_modes=("exact",))
    out += call_variants(2, 8, 2, 384, 256, 16, 132 // 2, (True,))  # tests/gpu/test_timeout.py
    from .test_custom_op_gpu import E as OP_E, H as OP_H, I as OP_I, K as OP_K, MAX_TOKENS as OP_MAX_TOKENS

    out += call_variants(1, OP_E, OP_K, OP_H, OP_I, OP_MAX_TOKENS, 132, (True,))
    out += call_variants(1, 16, 8, 2048, 768, 256, 132, (True,))  # tools/soak.py
    out += call_variants(1, 32, 8, 2048, 768, 513, 132, (True,))  # tests/gpu/test_batch_invariance.py
    from .test_timeline_gpu import timeline_variants

    out += timeline_variants()
    # tools/tile_timeline.py (TIMELINE=1 in tools/gpu_check.sh): its default configs, in fast numerics.
    for ref in (REFERENCE_SHAPES["v3"], REFERENCE_SHAPES["v4flash"]):
        out += [dataclasses.replace(v, timeline=True)
                for v in call_variants(1, ref.num_local_experts, ref.num_topk, ref.hidden, ref.intermediate_size, 8192,
                                       132, (True,), numerics_modes=("fast",))]
    out += lag_variants()
    # tests/gpu/test_delayed_rank.py: two ranks of MULTI_RANK_SHAPES[1] on 132 // 2 SMs (above).
    from .test_shared_experts_gpu import HIDDEN as SHARED_H, INTER as SHARED_I, SIDE_BY_SIDE

    for num_ranks in (2, 4, 8):  # tests/gpu/test_shared_experts_gpu.py: one shared expert per rank
        local, topk, max_tokens = SIDE_BY_SIDE["local_routed"], SIDE_BY_SIDE["topk"], SIDE_BY_SIDE["max_tokens"]
        out += call_variants(num_ranks, local * num_ranks, topk, SHARED_H, SHARED_I, max_tokens, 132 // num_ranks,
                             (True,), num_shared_experts=1)
    for num_sms in (132, 124, 116):  # tools/aux_stream_stall.py
        out += call_variants(1, 32, 8, 7168, 2048, 64, num_sms, (True,))
    out += mxfp4_variants()
    return list(dict.fromkeys(out))


def mxfp4_variants():
    """What tests/gpu/test_mxfp4_weights_gpu.py loads."""
    from .multi_rank import MULTI_RANK_SHAPES

    fast_fp4 = dict(numerics_modes=("fast",), weights="mxfp4")
    out = []
    for s in MXFP4_SHAPES:
        out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132, **fast_fp4)
    for block_m in mxfp4_tiers():
        for s in FORCED_TIER_SHAPES:
            out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132,
                                 forced_block_m=block_m, **fast_fp4)
        s = WINDOW_SHAPES[0]
        for pool_rows in (WINDOW_POOL_ROWS, None):
            out += call_variants(1, s.local_experts, s.topk, s.hidden, s.intermediate, s.max_tokens, 132, (True,),
                                 forced_block_m=block_m, pool_rows=pool_rows, **fast_fp4)
    for hidden, inter, topk, local_experts, max_tokens, _ in MULTI_RANK_SHAPES:
        for num_ranks in (2, 4):
            out += call_variants(num_ranks, local_experts * num_ranks, topk, hidden, inter, max_tokens,
                                 132 // num_ranks, (True,), **fast_fp4)
    return out


# compute-sanitizer's runs: tools/debug_phases.py H I K E N on SANITIZER_SMS CTAs with each tier
# forced, its pool rows (None: the default pools), its shared experts and its experts' weight format, all
# on each job line. A small shape; one at I 2048 whose pool rows outnumber those pulled before L1 (fast
# numerics pulls the rest during L1); pools of 128 rows for 256 entries, so that every tier runs the call
# in pool windows (the window kernel too); a shared expert beside the routed ones, which every token's
# extra slot names; and MXFP4 experts (read at 4 bits, converted on chip) on default and windowed pools.
SANITIZER_SMS = 8  # tools/sanitizer_sweep.sh: fewer CTAs spinning on flags under the tools
SANITIZER_SHAPES = [((384, 256, 4, 4, 16), ("fast", "exact"), None, 0, "fp8"),
                    ((384, 2048, 4, 4, 64), ("fast",), None, 0, "fp8"),
                    ((384, 256, 4, 4, 64), ("fast", "exact"), 128, 0, "fp8"),
                    ((384, 256, 4, 4, 33), ("fast", "exact"), None, 1, "fp8"),
                    ((384, 256, 4, 4, 33), ("fast",), None, 0, "mxfp4"),
                    ((384, 256, 4, 4, 64), ("fast",), 128, 0, "mxfp4")]


def sanitizer_variants():
    from megamoe_plugin.heuristics import implemented_block_m

    out = []
    for (hidden, inter, topk, experts, tokens), modes, pool_rows, shared, weights in SANITIZER_SHAPES:
        for numerics in modes:
            for block_m in implemented_block_m(numerics, weights):
                out += call_variants(1, experts, topk, hidden, inter, tokens, SANITIZER_SMS, (True,),
                                     forced_block_m=block_m, numerics_modes=(numerics,), pool_rows=pool_rows,
                                     num_shared_experts=shared, weights=weights)
    return out


def sanitizer_jobs(numerics_modes=None, tiers=None):
    """One line per job: numerics, tool, BLOCK_M, tools/debug_phases.py's H I K E N, pool rows or "-", CTAs,
    shared experts, weight format."""
    from megamoe_plugin.heuristics import implemented_block_m

    for shape, modes, pool_rows, shared, weights in sorted(SANITIZER_SHAPES, key=lambda job: -job[0][-1]):  # the longest first
        for numerics in modes:
            if numerics_modes and numerics not in numerics_modes:
                continue
            for tool in ("racecheck", "memcheck"):
                for block_m in implemented_block_m(numerics, weights):
                    if not tiers or block_m in tiers:
                        yield " ".join(map(str, (numerics, tool, block_m, *shape, pool_rows or "-", SANITIZER_SMS,
                                                 shared, weights)))


# tools/tile_timeline.py's pull / scatter lag runs: (ranks side by side on one H200, numerics), each at
# v3 and v4flash with LAG_TOKENS tokens per rank (exact numerics pulls every row before L1, fast at
# I >= 2048 the later rows during it: that is the one to see across ranks).
LAG_RUNS = [(1, "fast"), (1, "exact"), (2, "fast")]
LAG_TOKENS = (1, 128, 2048, 8192)


def lag_timeline_variants(num_ranks, num_sms, numerics):
    """The timeline builds tools/tile_timeline.py loads for v3 and v4flash at LAG_TOKENS per rank,
    R ranks on num_sms SMs each."""
    from megamoe_plugin.bench.cli import LOCAL_EXPERTS
    from megamoe_plugin.buffer import BufferShape
    from megamoe_plugin.configs import REFERENCE_SHAPES
    from megamoe_plugin.variants import variant_for

    out = []
    for name in ("v3", "v4flash"):
        ref = REFERENCE_SHAPES[name]
        shape = BufferShape(num_ranks, LOCAL_EXPERTS * num_ranks, max(LAG_TOKENS), ref.num_topk, ref.hidden,
                            ref.intermediate_size)
        out += [dataclasses.replace(variant_for(shape, "NVIDIA H200", num_sms, n, True, numerics, None), timeline=True)
                for n in LAG_TOKENS]
    return out


def lag_variants():
    """tools/tile_timeline.py's LAG_RUNS, R ranks side by side on one H200."""
    return list(dict.fromkeys(v for num_ranks, numerics in LAG_RUNS
                              for v in lag_timeline_variants(num_ranks, 132 // num_ranks, numerics)))


def x2_variants():
    """Two H200s, one process each on all 132 SMs (torchrun): tests.gpu.multi_rank (tests/gpu/test_two_gpus.py)
    in both numerics modes, python -m megamoe_plugin.bench at R = 2 (v3, v4flash), and
    tools/tile_timeline.py's lag at LAG_TOKENS in fast numerics."""
    from megamoe_plugin.bench.cli import LOCAL_EXPERTS
    from megamoe_plugin.configs import REFERENCE_SHAPES

    from .multi_rank import MULTI_RANK_SHAPES

    out = []
    for hidden, inter, topk, local_experts, max_tokens, _ in MULTI_RANK_SHAPES:
        out += call_variants(2, local_experts * 2, topk, hidden, inter, max_tokens, 132, (True,))
    for name in ("v3", "v4flash"):
        ref = REFERENCE_SHAPES[name]
        out += call_variants(2, 2 * LOCAL_EXPERTS, ref.num_topk, ref.hidden, ref.intermediate_size, 8192, 132, (True,))
    out += lag_timeline_variants(2, 132, "fast")
    return list(dict.fromkeys(out))


def bench_variants():
    from megamoe_plugin.configs import REFERENCE_SHAPES

    out = []
    for name in ("v3", "v4flash"):
        ref = REFERENCE_SHAPES[name]
        out += call_variants(1, ref.num_local_experts, ref.num_topk, ref.hidden, ref.intermediate_size, 8192, 132,
                             (True,))
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--jobs", action="store_true")
    ap.add_argument("--lag", action="store_true")
    ap.add_argument("--x2", action="store_true")
    ap.add_argument("--numerics", help="with --jobs: these modes only (comma-separated)")
    ap.add_argument("--tiers", help="with --jobs: these BLOCK_M only (comma-separated)")
    ap.add_argument("--gpu", help="select variants as on this GPU (its name as torch reports it; default: this "
                                  f"machine's GPU, else {GPU_NAME!r})")
    args = ap.parse_args()
    if args.gpu:
        GPU_NAME = args.gpu
    else:
        import torch

        if torch.cuda.is_available():
            GPU_NAME = torch.cuda.get_device_name()
    if args.jobs:
        print("\n".join(sanitizer_jobs(args.numerics.split(",") if args.numerics else None,
                                        [int(t) for t in args.tiers.split(",")] if args.tiers else None)))
        sys.exit(0)
    from megamoe_plugin.jit.check import check_variants

    chosen = (bench_variants() if args.bench else lag_variants() if args.lag else x2_variants() if args.x2
              else list(dict.fromkeys(variants() + sanitizer_variants())))
    sys.exit(1 if check_variants(chosen) else 0)
