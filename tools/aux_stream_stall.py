"""Does a dense GEMM on another stream stall the persistent grid, and by how much?

vLLM 0.33 runs a shared-expert model's shared expert on an auxiliary stream at small
batch sizes, concurrently with the routed MoE. Every CTA of our grid must be resident at
once (grid barriers): a CTA whose SM is taken by a GEMM block starts only when that block
retires, and the CTAs already running wait for it at the first grid barrier. So the
question is whether that happens, and what it costs, at each grid size MEGAMOE_NUM_SMS
can set (the tool sets the buffer's grid size directly, which is what the variable does).

For each grid size and token count, with a shared-expert model's routed shape (v3: H 7168,
I 2048, top-8, 32 local experts per rank) and a shared expert of the same H and I (one
[T, H] x [H, 2I] and one [T, I] x [I, H] GEMM, FP8 `torch._scaled_mm` or BF16):
  alone     the kernel's and the GEMMs' times, each from a start event on its stream
  gemm1st   the GEMMs launched on the aux stream just before the kernel (what vLLM does by itself)
  kernel1st the kernel launched first
  serial    the GEMMs, then the kernel, on one stream (what the plugin's vLLM glue does)
  stall     kernel time with the GEMMs minus alone; "STALL" when it is at least half the
            GEMMs' own time (the kernel sat waiting for SMs rather than sharing them)
  layer     for each order, when the later of the two ended: what the layer costs
Medians over --iters. Every output is compared bitwise with the one of the kernel run alone,
and the run ends with ops.synchronize(), so a lost row or a timeout shows.

    python3 tools/aux_stream_stall.py [--sms 132,124,116] [--tokens 1,8,16,32,64] [--gemm fp8|bf16]
        [--iters 50] [--json out.json]
"""
import argparse
import json
import statistics

import torch

import megamoe_plugin as mm
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer

HIDDEN, INTER, TOPK, LOCAL_EXPERTS = 7168, 2048, 8, 32


class SharedExpert:
    """The shared expert's two GEMMs for up to `max_tokens` tokens (rows padded to 16 for FP8)."""

    def __init__(self, max_tokens, dtype, gen):
        rows = -(-max_tokens // 16) * 16
        self.fp8 = dtype == "fp8"
        kind = torch.float8_e4m3fn if self.fp8 else torch.bfloat16

        def rand(*shape):
            return (torch.randn(*shape, generator=gen, device="cuda") * 0.05).to(kind)

        self.x, self.act = rand(rows, HIDDEN), rand(rows, INTER)
        self.w13, self.w2 = rand(2 * INTER, HIDDEN), rand(HIDDEN, INTER)
        self.one = torch.ones((), device="cuda")

    def __call__(self, n):
        rows = -(-n // 16) * 16 if self.fp8 else n
        x, act = self.x[:rows], self.act[:rows]
        if self.fp8:
            torch._scaled_mm(x, self.w13.t(), scale_a=self.one, scale_b=self.one, out_dtype=torch.bfloat16)
            torch._scaled_mm(act, self.w2.t(), scale_a=self.one, scale_b=self.one, out_dtype=torch.bfloat16)
        else:
            torch.mm(x, self.w13.t())
            torch.mm(act, self.w2.t())


def timed(kernel, gemm, order, aux):
    """One round from a common start event: (kernel us, gemm us); None for what did not run."""
    main = torch.cuda.current_stream()
    start, k_end, g_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    start.record(main)
    aux.wait_event(start)

    def run_kernel():
        kernel()
        k_end.record(main)

    def run_gemm():
        with torch.cuda.stream(aux):
            gemm()
            g_end.record(aux)

    def run_gemm_on_main():
        gemm()
        g_end.record(main)

    steps = {"alone": [run_kernel], "gemm": [run_gemm], "gemm1st": [run_gemm, run_kernel],
             "kernel1st": [run_kernel, run_gemm], "serial": [run_gemm_on_main, run_kernel]}[order]
    for step in steps:
        step()
    main.wait_stream(aux)
    torch.cuda.synchronize()
    return (start.elapsed_time(k_end) * 1e3 if run_kernel in steps else None,
            start.elapsed_time(g_end) * 1e3 if run_kernel not in steps or len(steps) > 1 else None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sms", default="132,124,116", help="grid sizes (MEGAMOE_NUM_SMS values)")
    parser.add_argument("--tokens", default="1,8,16,32,64")
    parser.add_argument("--gemm", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = random_layer(LOCAL_EXPERTS, HIDDEN, INTER, "cuda", gen)
    buf = mm.get_symm_buffer(None, LOCAL_EXPERTS, max(tokens_list), TOPK, HIDDEN, INTER)
    shared = SharedExpert(max(tokens_list), args.gemm, gen)
    aux = torch.cuda.Stream()
    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {device_sms} SMs; routed H{HIDDEN} I{INTER} K{TOPK} "
          f"{LOCAL_EXPERTS} local experts; shared expert {args.gemm.upper()} GEMMs; median of {args.iters}")
    print(f"{'sms':>4s} {'tokens':>6s} {'kernel':>8s} {'gemm':>7s} {'gemm1st k/g':>15s} {'kernel1st k/g':>15s} "
          f"{'stall':>7s} {'layer: gemm1st':>14s} {'kernel1st':>9s} {'serial':>7s}  verdict")
    rows = []
    for sms in (int(s) for s in args.sms.split(",")):
        buf.num_sms = sms
        mm.ops.warmup(buf, layer.l1, layer.l2, tokens_list)
        for n in tokens_list:
            fill_buffer(buf, random_inputs(n, HIDDEN, LOCAL_EXPERTS, TOPK, "uniform", "cuda", gen))
            y = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device="cuda")
            expected = None

            def kernel():
                mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)

            times = {}
            for order in ("alone", "gemm", "gemm1st", "kernel1st", "serial"):
                runs = []
                for _ in range(args.iters):
                    y.fill_(float("nan"))
                    runs.append(timed(kernel, lambda: shared(n), order, aux))
                    if order != "gemm":
                        if expected is None:
                            expected = y.clone()
                        assert torch.equal(y, expected), f"output changed with {order} at {sms} SMs, {n} tokens"
                times[order] = tuple(statistics.median(t[i] for t in runs) if runs[0][i] is not None else None
                                     for i in range(2))
            mm.ops.synchronize()
            kernel_alone, gemm_alone = times["alone"][0], times["gemm"][1]
            stall = max(times["gemm1st"][0], times["kernel1st"][0]) - kernel_alone
            verdict = "STALL" if stall >= 0.5 * gemm_alone else "ok"
            layer_us = {order: max(times[order]) for order in ("gemm1st", "kernel1st", "serial")}
            row = dict(sms=sms, tokens=n, gemm=args.gemm, kernel_alone_us=kernel_alone, gemm_alone_us=gemm_alone,
                       gemm_first_us=times["gemm1st"], kernel_first_us=times["kernel1st"], serial_us=times["serial"],
                       stall_us=stall, layer_us=layer_us, verdict=verdict)
            rows.append(row)
            print(f"{sms:4d} {n:6d} {kernel_alone:8.1f} {gemm_alone:7.1f} "
                  f"{times['gemm1st'][0]:7.1f}/{times['gemm1st'][1]:7.1f} "
                  f"{times['kernel1st'][0]:7.1f}/{times['kernel1st'][1]:7.1f} {stall:7.1f} "
                  f"{layer_us['gemm1st']:14.1f} {layer_us['kernel1st']:9.1f} {layer_us['serial']:7.1f}  {verdict}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
