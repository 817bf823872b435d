"""Round 24: what pool windows cost on one H200, v4flash (H 4096, I 2048, top-6, 32 experts), a buffer
for 8192 tokens, fast numerics, each call a CUDA graph replay after an L2 flush (median of 20):
  whole  the default pools (one rank: every routing fits, no window kernel);
  idle   pools 128 rows short of the worst routing: the windowed variant, whose calls here all fit
         in the first window, so the window kernel is launched and returns at once;
  4096   4096-row pools: calls of more rows run in windows (at 8192 tokens about a dozen).
`python docs/results/2026-12-04-h200-r24/window_overhead.py` (on the GPU machine); with --variants it
compiles what it loads instead (on the CPU machine, MEGAMOE_CACHE_DIR)."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import megamoe_plugin as mm  # noqa: E402
from megamoe_plugin.buffer import BufferShape  # noqa: E402

H, I, K, E, N = 4096, 2048, 6, 32, 8192
TOKENS = (1, 128, 2048, 8192)


def pools():
    worst = BufferShape(1, E, N, K, H, I).max_pool_rows
    return {"whole": None, "idle": worst - 128, "4096": 4096}


def main():
    import torch

    from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer
    from megamoe_plugin.timing import graphed, l2_flusher, median_call_seconds

    gen = torch.Generator(device="cuda").manual_seed(24)
    layer = random_layer(E, H, I, "cuda", gen)
    flush = l2_flusher()
    inputs = {n: random_inputs(n, H, E, K, "uniform", "cuda", gen) for n in TOKENS}
    print(f"{'tokens':>6s} " + " ".join(f"{name:>12s}" for name in pools()) + "   (us)")
    for n in TOKENS:
        times = []
        for pool_rows in pools().values():
            buf = mm.get_symm_buffer(None, E, N, K, H, I, pool_rows=pool_rows)
            fill_buffer(buf, inputs[n])
            y = torch.full((n, H), math.nan, dtype=torch.bfloat16, device="cuda")
            replay = graphed(lambda: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, numerics="fast"))
            times.append(median_call_seconds(replay, 20, before=flush) * 1e6)
            del buf
        print(f"{n:6d} " + " ".join(f"{t:12.1f}" for t in times), flush=True)


def variants():
    from megamoe_plugin.jit import check_variants
    from megamoe_plugin.variants import variant_for

    out = {variant_for(BufferShape(1, E, N, K, H, I, rows), "NVIDIA H200", 132, n, True, "fast")
           for rows in pools().values() for n in TOKENS}
    return check_variants(sorted(out, key=lambda v: v.name()))


if __name__ == "__main__":
    sys.exit(1 if (variants() if sys.argv[1:] == ["--variants"] else main()) else 0)
