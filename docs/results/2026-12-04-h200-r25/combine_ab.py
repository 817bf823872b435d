"""Round 25: the combine phase's time over many buffers (call 2 found it bimodal from one buffer to the
next: 137-168 or 330-340 us at v4flash 8192 tokens). Per config, --buffers buffers one after another (each
freed before the next), one layer and one routing; per buffer the full call and the call stopped after L2
(tools/phase_times.py's way: eager calls, the L2 flushed before each, median of --iters; in call 4 its
`reset_and_flush` also zeroed the counters a stopped call left, which the next call now zeroes itself);
prints full, stopped and combine = full - stopped, in us. Run it under two trees to compare them.

    python3 docs/results/2026-12-04-h200-r25/combine_ab.py [--configs v4flash,v3] [--tokens 8192] [--buffers 6]
"""
import argparse
import functools
import statistics

import torch

import megamoe_plugin as mm
from megamoe_plugin.configs import REFERENCE_SHAPES
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer
from megamoe_plugin.timing import l2_flusher, median_call_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4flash,v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--buffers", type=int, default=6)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    flush = l2_flusher()
    n = args.tokens
    for name in args.configs.split(","):
        ref = REFERENCE_SHAPES[name]
        H, I, K, E = ref.hidden, ref.intermediate_size, ref.num_topk, ref.num_local_experts
        gen = torch.Generator(device="cuda").manual_seed(25)
        layer = random_layer(E, H, I, "cuda", gen)
        inputs = random_inputs(n, H, E, K, "uniform", "cuda", gen)
        y = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")
        combines, bufs = [], []
        for b in range(args.buffers):
            buf = mm.get_symm_buffer(None, E, n, K, H, I)
            bufs.append(buf)
            fill_buffer(buf, inputs)
            before = flush
            times = {}
            for stop in (6, 0):
                call = functools.partial(mm.fp8_mega_moe, y, layer.l1, layer.l2, buf, _stop_after_phase=stop)
                times[stop] = median_call_seconds(call, args.iters, before) * 1e6
            combines.append(times[0] - times[6])
            print(f"{args.label} {name} n={n} buffer {b}: full {times[0]:.1f} us, stopped after L2 {times[6]:.1f}, "
                  f"combine {combines[-1]:.1f}", flush=True)
        print(f"{args.label} {name} n={n}: combine median {statistics.median(combines):.1f} us, "
              f"min {min(combines):.1f}, max {max(combines):.1f}", flush=True)
        del bufs, buf, layer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
