"""Per-token error of the kernel against docs/design.md section 2's references, at token counts
larger than the tests use, to see the tail of the distribution the bounds cut: for each
numerics mode against the exact reference, and for "fast" also against the reference whose
L1 is FP8 tensor cores (testing.fp8_tensor_core_l1). --tiers forces tile tiers
(MEGAMOE_BLOCK_M), to compare the FP8 L1 main loops. Needs a GPU.

    python3 tools/numerics_stats.py [--configs v4flash,v3] [--tokens 4096] [--seeds 2]
        [--numerics fast,exact] [--tiers 8,16,32,64] [--no-fast-math]
"""
import argparse
import os

import torch

import megamoe_plugin as mm
from megamoe_plugin import reference
from megamoe_plugin.configs import REFERENCE_SHAPES
from megamoe_plugin.testing import fill_buffer, fp8_tensor_core_l1, random_inputs, random_layer, reference_outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen30,qwen235,v4flash,v3")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--numerics", default="fast,exact")
    parser.add_argument("--tiers", default="", help="comma-separated BLOCK_M tiers to force; default: the heuristic's")
    parser.add_argument("--no-fast-math", dest="fast_math", action="store_false")
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t] or [None]
    for name in args.configs.split(","):
        s = REFERENCE_SHAPES[name]
        hidden, inter, topk, experts = s.hidden, s.intermediate_size, s.num_topk, s.num_local_experts
        for seed in range(args.seeds):
            gen = torch.Generator(device="cuda").manual_seed(100 + seed)
            layer = random_layer(experts, hidden, inter, "cuda", gen)
            buf = mm.get_symm_buffer(None, experts, args.tokens, topk, hidden, inter)
            inputs = random_inputs(args.tokens, hidden, experts, topk, "uniform", "cuda", gen)
            fill_buffer(buf, inputs)
            refs = {"exact": reference_outputs([inputs], [layer], experts)[0]}
            for numerics in args.numerics.split(","):
                for tier in tiers:
                    if tier is None:
                        os.environ.pop("MEGAMOE_BLOCK_M", None)
                    else:
                        os.environ["MEGAMOE_BLOCK_M"] = tier
                    block_m = mm.ops.select_variant(buf, args.tokens, args.fast_math, numerics).block_m
                    y = torch.full((args.tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
                    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, fast_math=args.fast_math, numerics=numerics)
                    mm.ops.synchronize()
                    label = f"{name} seed {seed} {numerics} BLOCK_M {block_m} fast_math={args.fast_math}"
                    bound = reference.NUMERICS_BOUNDS[numerics][1]
                    print(f"{label} vs exact: {reference.error_summary(y, refs['exact'], bound)}", flush=True)
                    if numerics == "fast":
                        if "tensor_core" not in refs:
                            refs["tensor_core"] = reference_outputs([inputs], [layer], experts,
                                                                    l1_gemm=fp8_tensor_core_l1)[0]
                        bound = reference.FAST_VS_FP8_TENSOR_CORE_BOUNDS[1]
                        print(f"{label} vs FP8 tensor cores: {reference.error_summary(y, refs['tensor_core'], bound)}",
                              flush=True)
            del buf
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
