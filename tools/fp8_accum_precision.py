"""How close can any FP8 tensor-core L1 GEMM get to the exact reference?

Computes each expert's L1 output with cuBLAS FP8 GEMMs (torch._scaled_mm, fast
accumulation off, one GEMM per 128-wide k-block, block scales applied in float32: the
same promotion scheme as the kernel) and pushes it through the rest of the reference
pipeline. Reports how far the L1 output and the requantized codes move from the exact
(float64) reference and the resulting per-token error of y, so the kernel's numbers
(docs/results) can be compared with what the hardware allows.

    python3 tools/fp8_accum_precision.py [H I K E N]
"""
import sys

import torch
import torch.nn.functional as F

from megamoe_plugin.fp8 import dequantize_per_token_group, dequantize_weight_blocks, requantize_groups
from megamoe_plugin.reference import calc_diff
from megamoe_plugin.testing import fp8_tensor_core_l1, random_inputs, random_layer


def main():
    H, I, K, E, N = [int(a) for a in sys.argv[1:]] or [2048, 768, 8, 32, 512]
    gen = torch.Generator(device="cuda").manual_seed(7)
    layer = random_layer(E, H, I, "cuda", gen)
    inp = random_inputs(N, H, E, K, "uniform", "cuda", gen)
    w = layer.checkpoint
    a = dequantize_per_token_group(inp["x"], inp["x_sf"])
    idx = inp["topk_idx"].reshape(-1)
    weights = inp["topk_weights"].reshape(-1)
    y_exact = torch.zeros(N * K, H, dtype=torch.bfloat16, device="cuda")
    y_fp8 = torch.zeros_like(y_exact)
    flips = total = 0
    max_sf_dev = 0.0
    for e in range(E):
        entries = torch.nonzero(idx == e).squeeze(1)
        if entries.numel() == 0:
            continue
        tok = entries // K
        b13 = dequantize_weight_blocks(w["w13"][e], w["w13_scale"][e])
        b2 = dequantize_weight_blocks(w["w2"][e], w["w2_scale"][e])
        h_exact = (a[tok].double() @ b13.double().T).float()
        h_fp8 = fp8_tensor_core_l1(inp["x"][tok], inp["x_sf"][tok], w["w13"][e], w["w13_scale"][e])
        outs = []
        for h in (h_exact, h_fp8):
            act = F.silu(h[:, :I]) * h[:, I:] * weights[entries, None]
            q, s = requantize_groups(act, 128)
            o = (dequantize_per_token_group(q, s).double() @ b2.double().T).float().to(torch.bfloat16)
            outs.append((q, s, o))
        flips += int((outs[0][0].view(torch.uint8) != outs[1][0].view(torch.uint8)).sum())
        total += outs[0][0].numel()
        max_sf_dev = max(max_sf_dev, float(((outs[1][1] - outs[0][1]).abs() / outs[0][1]).max()))
        y_exact[entries] = outs[0][2]
        y_fp8[entries] = outs[1][2]
    ye = y_exact.view(N, K, H).float().sum(1).to(torch.bfloat16).double()
    yf = y_fp8.view(N, K, H).float().sum(1).to(torch.bfloat16).double()
    tok_rel = (yf - ye).norm(dim=1) / ye.norm(dim=1)
    print(f"cuBLAS FP8 L1 (promotion per 128, fast accum off), H{H} I{I} K{K} E{E} N{N}:")
    print(f"  act_q codes differing from exact: {flips} of {total} ({flips / total:.2e}); "
          f"act_sf max rel deviation {max_sf_dev:.2e}")
    print(f"  y vs exact: calc_diff {calc_diff(yf, ye):.2e}; per-token rel err p50 {float(tok_rel.median()):.2e} "
          f"p99 {float(tok_rel.quantile(0.99)):.2e} max {float(tok_rel.max()):.2e}; "
          f"{int((tok_rel > 1e-2).sum())} of {N} tokens over 1e-2")


if __name__ == "__main__":
    main()
