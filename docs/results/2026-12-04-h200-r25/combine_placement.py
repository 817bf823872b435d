"""Round 25, call 3: is the combine's bimodal time (call 2: 137-168 or 330-340 us at v4flash 8192 tokens,
in both pool layouts, from one process to the next) set by where y lies relative to the buffer? One buffer,
one layer, one routing; y carved out of one large allocation at several byte offsets; each placement
timed as tools/pool_window_cost.py times a call (graph replay after an L2 flush, median of --iters), the
placements in rotating order over --rounds rounds; then the phase stop after L2 on the first placement,
so that total - that = the combine. Prints us per placement (median of rounds) and each round's value.

    python3 docs/results/2026-12-04-h200-r25/combine_placement.py [--config v4flash] [--tokens 8192]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

import megamoe_plugin as mm  # noqa: E402
from megamoe_plugin.configs import REFERENCE_SHAPES  # noqa: E402
from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer  # noqa: E402
from megamoe_plugin.timing import graphed, l2_flusher, median_call_seconds  # noqa: E402

OFFSETS_KIB = [0, 4, 64, 256, 1024, 2048, 3072, 4096 + 4, 8192 + 512, 24576 + 1536]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="v4flash")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    ref = REFERENCE_SHAPES[args.config]
    H, I, K, E, n = ref.hidden, ref.intermediate_size, ref.num_topk, ref.num_local_experts, args.tokens
    gen = torch.Generator(device="cuda").manual_seed(25)
    layer = random_layer(E, H, I, "cuda", gen)
    buf = mm.get_symm_buffer(None, E, n, K, H, I)
    fill_buffer(buf, random_inputs(n, H, E, K, "uniform", "cuda", gen))
    flush = l2_flusher()
    y_bytes = n * H * 2
    arena = torch.empty(max(OFFSETS_KIB) * 1024 + y_bytes, dtype=torch.uint8, device="cuda")
    combine_at = buf.storage.data_ptr() + buf.layout.regions["combine"].offset
    print(f"{args.config} n={n}: arena at {arena.data_ptr():#x}; combine region at {combine_at:#x}")
    replays = {}
    for kib in OFFSETS_KIB:
        y = arena[kib * 1024: kib * 1024 + y_bytes].view(torch.bfloat16).view(n, H)
        replays[kib] = (y, graphed(lambda y=y: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf)))
    times = {kib: [] for kib in OFFSETS_KIB}
    for r in range(args.rounds):
        order = OFFSETS_KIB[r % len(OFFSETS_KIB):] + OFFSETS_KIB[:r % len(OFFSETS_KIB)]
        for kib in order:
            times[kib].append(median_call_seconds(replays[kib][1], args.iters, before=flush) * 1e6)
    for kib in OFFSETS_KIB:
        y = replays[kib][0]
        print(f"y at arena + {kib:6d} KiB ({y.data_ptr():#x}, mod 2 MiB {y.data_ptr() % (2 << 20):#x}): "
              f"{statistics.median(times[kib]):8.1f} us  rounds " + " ".join(f"{t:.1f}" for t in times[kib]),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
