"""FP8 quantization written from the contract (docs/design.md section 2) for the framework
layer tests (tests/vllm_plugin, tests/sglang_plugin): their torch MoE oracles share no code with the
plugin, so a bug in megamoe_plugin.fp8 cannot hide in both sides of a comparison."""
import torch

FP8 = torch.float8_e4m3fn


def quant_blocks(w):
    """128x128 block FP8 of a [N, K] weight: (q, s [N/128, K/128])."""
    n, k = w.shape
    blocks = w.float().reshape(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-10) / 448.0
    q = (blocks / scale).clamp(-448.0, 448.0).to(FP8)
    return q.reshape(n, k), scale.reshape(n // 128, k // 128)


def dequant_blocks(q, s):
    n, k = q.shape
    return (q.float().reshape(n // 128, 128, k // 128, 128) * s.reshape(n // 128, 1, k // 128, 1)).reshape(n, k)


def quant_dequant_rows(x):
    """Per-token, per-128-column FP8 quantize then dequantize (the frameworks' dynamic activation quant)."""
    t, h = x.shape
    g = x.float().reshape(t, h // 128, 128)
    s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
    return ((g / s).clamp(-448.0, 448.0).to(FP8).float() * s).reshape(t, h)
