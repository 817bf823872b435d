"""Per-token error of the kernel against the exact reference of DESIGN.md section 2, at
token counts larger than the tests use, to see the tail of the distribution the 1e-2
bound cuts. Needs a GPU.

    python3 tools/exact_bound_stats.py [--configs v4flash,v3] [--tokens 4096] [--seeds 2] [--no-fast-math]
"""
import argparse

import torch

import megamoe_plugin as mm
from megamoe_plugin import reference
from megamoe_plugin.configs import REFERENCE_SHAPES
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer, reference_outputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="qwen30,qwen235,v4flash,v3")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--no-fast-math", dest="fast_math", action="store_false")
    args = parser.parse_args()
    for name in args.configs.split(","):
        s = REFERENCE_SHAPES[name]
        hidden, inter, topk, experts = s.hidden, s.intermediate_size, s.num_topk, s.num_local_experts
        for seed in range(args.seeds):
            gen = torch.Generator(device="cuda").manual_seed(100 + seed)
            layer = random_layer(experts, hidden, inter, "cuda", gen)
            buf = mm.get_symm_buffer(None, experts, args.tokens, topk, hidden, inter)
            inputs = random_inputs(args.tokens, hidden, experts, topk, "uniform", "cuda", gen)
            fill_buffer(buf, inputs)
            y = torch.full((args.tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, fast_math=args.fast_math)
            mm.ops.synchronize()
            ref = reference_outputs([inputs], [layer], experts)[0]
            print(f"{name} seed {seed} fast_math={args.fast_math}: {reference.error_summary(y, ref)}", flush=True)
            del buf
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
