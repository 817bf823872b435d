"""Kernel benchmark on one GPU against the floors of DESIGN.md section 8.

For each reference config and token count: kernel device time (median of --iters
calls, L2 flushed before each), TFLOPS, and the floor max(bytes / measured HBM
bandwidth, FLOPs / measured FP8 GEMM rate) with time / floor. Both ceilings are
measured in the same run.

    python benchmarks/bench_kernel.py [--configs v3,v4flash] [--tokens 1,8,128] [--iters 20]
"""
import argparse
import statistics

import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer

CONFIGS = {"v3": (7168, 2048, 8), "v4flash": (4096, 2048, 6), "qwen235": (4096, 1536, 8), "qwen30": (2048, 768, 8)}
LOCAL_EXPERTS = 32


def measure_hbm_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def measure_fp8_rate() -> float:
    """FLOP/s of an 8192^3 FP8 GEMM through torch._scaled_mm."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (start.elapsed_time(end) * 1e-3)


def floor_seconds(inputs, hidden, inter, topk, bandwidth, fp8_rate):
    idx = inputs["topk_idx"]
    rows = int((idx >= 0).sum())
    experts_hit = int(torch.unique(idx[idx >= 0]).numel())
    weight_bytes = experts_hit * (2 * inter * hidden + hidden * inter)
    act_bytes = idx.shape[0] * hidden * (1 + 2) + rows * (hidden + 2 * inter + 2 * hidden)
    flops = 2 * rows * (2 * inter * hidden + inter * hidden)
    return max((weight_bytes + act_bytes) / bandwidth, flops / fp8_rate), flops


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="v3,v4flash")
    parser.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    bandwidth, fp8_rate = measure_hbm_bandwidth(), measure_fp8_rate()
    print(f"device {torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, FP8 GEMM {fp8_rate / 1e12:.0f} TFLOP/s")
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'config':8s} {'tokens':>6s} {'time_us':>9s} {'TFLOPS':>7s} {'floor_us':>9s} {'ratio':>6s}")
    for name in args.configs.split(","):
        hidden, inter, topk = CONFIGS[name]
        layer = random_layer(LOCAL_EXPERTS, hidden, inter, "cuda", gen)
        buf = mm.get_symm_buffer(None, LOCAL_EXPERTS, max(tokens_list), topk, hidden, inter)
        for n in tokens_list:
            inputs = random_inputs(n, hidden, LOCAL_EXPERTS, topk, "uniform", "cuda", gen)
            fill_buffer(buf, inputs)
            y = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
            mm.ops.synchronize()
            times = []
            for _ in range(args.iters):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            t = statistics.median(times)
            floor, flops = floor_seconds(inputs, hidden, inter, topk, bandwidth, fp8_rate)
            print(f"{name:8s} {n:6d} {t * 1e6:9.1f} {flops / t / 1e12:7.1f} {floor * 1e6:9.1f} {t / floor:6.2f}",
                  flush=True)
        del layer, buf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
