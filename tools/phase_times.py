"""Where a call's time goes: runs the kernel stopped after each phase (the
`_stop_after_phase` debug switch) and prints the cumulative times and their differences.

    python3 tools/phase_times.py [--configs v4flash,v3] [--tokens 1,128,8192] [--iters 10] [--local-experts 32]
        [--pool-rows shortK | ROWS]   (pools of K rows fewer than the worst routing needs, or of ROWS:
                                       the windowed variant, docs/design.md 4.9; default: every row)

With --profile, each (config, tokens) instead runs the full call and the calls stopped
after each phase once more between cudaProfilerStart/Stop, for Nsight Compute to read
the hardware counters of exactly those launches (leave the clocks alone):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        python3 tools/phase_times.py --configs v4flash --tokens 1 --iters 1 --profile
"""
import argparse
import functools

import torch

import megamoe_plugin as mm
from megamoe_plugin.bench.cli import CONFIGS, LOCAL_EXPERTS
from megamoe_plugin.buffer import BufferShape
from megamoe_plugin.heuristics import WEIGHT_FORMATS
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer_of
from megamoe_plugin.timing import l2_flusher, median_call_seconds

PHASES = [(2, "count+list+rank barrier"), (4, "layout+pull"), (5, "L1 GEMM+epilogue"), (6, "L2 GEMM+scatter"),
          (0, "combine")]


def add_call_arguments(parser: argparse.ArgumentParser, tokens: str = "1,128,8192") -> None:
    parser.add_argument("--configs", default="v4flash,v3")
    parser.add_argument("--tokens", default=tokens)
    parser.add_argument("--local-experts", type=int, default=LOCAL_EXPERTS,
                        help="e.g. 128 for the tools/e2e model (qwen30's H/I/top-k with 128 experts)")
    parser.add_argument("--pool-rows", default=None,
                        help="shortK (K rows fewer than the worst routing needs) or a row count: windowed pools")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="fp8",
                        help="the experts' weight format (mxfp4: read at 4 bits, fast numerics)")


def layer_for(args, hidden: int, inter: int, gen: torch.Generator):
    """A random layer of --local-experts experts in the --weights format."""
    return random_layer_of(args.weights)(args.local_experts, hidden, inter, "cuda", gen)


def pool_rows_for(spec, shape: BufferShape):
    """--pool-rows as get_symm_buffer's pool_rows (None: the default pools)."""
    if spec is None:
        return None
    return shape.max_pool_rows - int(spec[len("short"):]) if spec.startswith("short") else int(spec)


def calls(args):
    """(config name, hidden, intermediate size, layer, buffer, y) per --configs x --tokens: random
    weights and uniform routing, the inputs written into the buffer (tools/tile_timeline.py too)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    for name in args.configs.split(","):
        hidden, inter, topk = CONFIGS[name]
        layer = layer_for(args, hidden, inter, gen)
        shape = BufferShape(1, args.local_experts, max(tokens_list), topk, hidden, inter)
        buf = mm.get_symm_buffer(None, args.local_experts, max(tokens_list), topk, hidden, inter,
                                 pool_rows=pool_rows_for(args.pool_rows, shape))
        for n in tokens_list:
            fill_buffer(buf, random_inputs(n, hidden, args.local_experts, topk, "uniform", "cuda", gen))
            yield name, hidden, inter, layer, buf, torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
        del layer, buf
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    add_call_arguments(parser)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="one more launch per phase inside profiler markers")
    args = parser.parse_args()
    flush = l2_flusher()
    for name, _, _, layer, buf, y in calls(args):
        cumulative = []
        before_call = flush  # a stopped call leaves counters set: the next call zeroes them first (kernel.cuh)
        for stop, _ in PHASES:
            call = functools.partial(mm.fp8_mega_moe, y, layer.l1, layer.l2, buf, _stop_after_phase=stop)
            cumulative.append(median_call_seconds(call, args.iters, before_call) * 1e6)
        parts = [cumulative[0]] + [b - a for a, b in zip(cumulative, cumulative[1:])]
        print(f"{name} n={y.shape[0]}: total {cumulative[-1]:.1f} us = " +
              ", ".join(f"{label} {t:.1f}" for (_, label), t in zip(PHASES, parts)), flush=True)
        if args.profile:  # launch order in the report: stopped after phase 2, 4, 5, 6, then the full call
            for stop, _ in PHASES:
                before_call()
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, _stop_after_phase=stop)
                torch.cuda.profiler.stop()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
