"""Round 26: exact mode now against the FP16-L1 kernel of the design contract's table (d7f41be).

Run once per tree, with that tree's megamoe_plugin first on sys.path and its JIT cache in
MEGAMOE_CACHE_DIR; the same seeds give both trees the same layer and inputs. Timing is the
contract's (d7f41be's benchmarks/bench_kernel.py): eager calls, the L2 flushed before each,
one CUDA-event pair per call, median of --iters after one warm-up. d7f41be has no numerics
argument: its only L1 is FP16 (today's "exact"); the tree under test is called with
numerics="exact".

    python exact_ab.py --label main [--configs v3,v4flash] [--tokens 1,...,8192] [--iters 20]
"""
import argparse
import inspect
import statistics

import torch

import megamoe_plugin as mm
from megamoe_plugin.configs import REFERENCE_SHAPES
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer


def call_us(fn, flush, iters):
    times = []
    for i in range(iters + 1):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i > 0:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--configs", default="v3,v4flash")
    parser.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    extra = {"numerics": "exact"} if "numerics" in inspect.signature(mm.fp8_mega_moe).parameters else {}
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for name in args.configs.split(","):
        s = REFERENCE_SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(1000)
        layer = random_layer(32, s.hidden, s.intermediate_size, "cuda", gen)
        buf = mm.get_symm_buffer(None, 32, max(tokens), s.num_topk, s.hidden, s.intermediate_size)
        row = []
        for n in tokens:
            inputs = random_inputs(n, s.hidden, 32, s.num_topk, "uniform", "cuda", gen)
            fill_buffer(buf, inputs)
            y = torch.empty(n, s.hidden, dtype=torch.bfloat16, device="cuda")
            row.append(call_us(lambda: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, **extra), flush, args.iters))
        print(f"{args.label:12s} {name:8s} " + " ".join(f"{n}:{t:.1f}" for n, t in zip(tokens, row)), flush=True)
        del layer, buf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
