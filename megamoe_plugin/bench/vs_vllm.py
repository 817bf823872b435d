"""One MoE layer through vLLM's own Triton FP8 MoE and through megamoe_sm90, on the same
BF16 hidden states, routing and block-FP8 weights: how far each is from the float32
reference of docs/design.md section 2 and from each other, and how long each takes beside
the floor. Needs an SM90 GPU and vllm (pip install 'megamoe_plugin[vllm,cutlass]').

Default shape: Qwen3-30B-A3B's MoE layer (H 2048, I 768, 128 experts, top-8) on one GPU.
Timed as vLLM runs decode: each path captured in a CUDA graph (megamoe: stage_inputs +
fp8_mega_moe; vLLM: fused_experts, which quantizes its input itself), L2 flushed before
every replay, median of --iters.

    python -m megamoe_plugin.bench.vs_vllm [--tokens 1,8,64,256,512]
        [--hidden 2048 --intermediate-size 768 --num-experts 128 --topk 8]
"""
import argparse
import importlib.util
import sys

import torch

import megamoe_plugin as mm
from megamoe_plugin.bench.baselines import vllm_triton_moe
from megamoe_plugin.bench.cli import require_sm90_gpu
from megamoe_plugin.bench.floors import Ceilings, measure_fp8_rate, measure_hbm_bandwidth, rank_floor
from megamoe_plugin.fp8 import quantize_per_token_group
from megamoe_plugin.reference import calc_diff, mega_moe, token_rel_errors
from megamoe_plugin.testing import random_layer, random_routing
from megamoe_plugin.timing import graphed, l2_flusher, median_call_seconds

PROG = "python -m megamoe_plugin.bench.vs_vllm"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,16,32,64,128,256,512",
                   help="comma-separated token counts (one GPU) (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=768,
                   help="expert intermediate size I (default: %(default)s)")
    p.add_argument("--num-experts", type=int, default=128, help="number of experts, all on this GPU "
                                                                "(default: %(default)s)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default: %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed graph replays per point; the median is "
                                                         "reported (default: %(default)s)")
    return p


def main():
    args = parser().parse_args()
    require_sm90_gpu(PROG)
    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"{PROG}: needs vllm (pip install 'megamoe_plugin[vllm,cutlass]'), which is not installed")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    h, inter, num_experts, topk = args.hidden, args.intermediate_size, args.num_experts, args.topk

    gen = torch.Generator(device="cuda").manual_seed(7)
    bandwidth, fp8_rate = measure_hbm_bandwidth(), measure_fp8_rate()
    flush = l2_flusher()
    layer = random_layer(num_experts, h, inter, "cuda", gen)
    triton_moe = vllm_triton_moe(layer.checkpoint)
    buf = mm.get_symm_buffer(None, num_experts, max(tokens_list), topk, h, inter)
    mm.ops.warmup(buf, layer.l1, layer.l2, tokens_list)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, FP8 GEMM {fp8_rate / 1e12:.0f} TFLOP/s; "
          f"H {h} I {inter} E {num_experts} top-{topk}")
    print(f"{'tokens':>6s} | {'megamoe_us':>10s} {'vllm_us':>8s} {'floor_us':>8s} {'mm/floor':>8s} {'vllm/mm':>7s} | "
          f"calc_diff and worst-token rel. error: megamoe-ref, vllm-ref, megamoe-vllm")
    for n in tokens_list:
        hidden = torch.randn(n, h, generator=gen, device="cuda").to(torch.bfloat16)
        idx = random_routing(n, num_experts, topk, "uniform", "cuda", gen)
        weights = torch.softmax(torch.randn(n, topk, generator=gen, device="cuda"), dim=-1)
        y = torch.full((n, h), float("nan"), dtype=torch.bfloat16, device="cuda")

        def megamoe():
            mm.stage_inputs(buf, hidden, idx, weights)
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)

        def vllm():
            return triton_moe(hidden, idx, weights)

        megamoe()
        y_vllm = vllm()
        x, x_sf = quantize_per_token_group(hidden)
        ref = mega_moe([dict(x=x, x_sf=x_sf, topk_idx=idx, topk_weights=weights)],
                       [layer.checkpoint], num_experts)[0]
        errors = [(calc_diff(a, b), token_rel_errors(a, b).max().item()) for a, b in ((y, ref), (y_vllm, ref), (y, y_vllm))]

        t_mm = median_call_seconds(graphed(megamoe), args.iters, flush)
        t_vllm = median_call_seconds(graphed(vllm), args.iters, flush)
        floor = rank_floor([idx.cpu()], 0, 1, h, inter, Ceilings(bandwidth, fp8_rate), num_experts)[0]
        print(f"{n:6d} | {t_mm * 1e6:10.1f} {t_vllm * 1e6:8.1f} {floor * 1e6:8.1f} {t_mm / floor:8.2f} "
              f"{t_vllm / t_mm:7.2f} | " + ", ".join(f"{d:.1e}/{r:.1e}" for d, r in errors), flush=True)


if __name__ == "__main__":
    main()
