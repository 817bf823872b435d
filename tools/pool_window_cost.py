"""What pool windows cost (docs/design.md 4.9), on one GPU, as an interleaved A/B of buffers: the
default pools (one rank: every routing fits, no window kernel) against pools of --pool-rows rows
(windowed variants: a call of more rows runs in windows; one that fits runs the first window only,
with the window kernel launched and returning at once). Rounds rotate the order of the buffers, so
that clock drift in a power-bound cell (8192 tokens) does not fall on one of them (round 24's first
measurement timed them in a fixed order). Each call is a CUDA graph replay after an L2 flush; the
table holds the median over rounds of each round's median of --iters calls, in us.

    python tools/pool_window_cost.py [--config v4flash] [--tokens 1,128,2048,8192] [--rounds 5]
        [--pool-rows short128,short1024,4096]   (shortK: K rows fewer than the worst routing needs)
    python tools/pool_window_cost.py ... --variants   # compile what it loads (CPU machine)
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe_plugin.buffer import BufferShape  # noqa: E402
from megamoe_plugin.configs import REFERENCE_SHAPES  # noqa: E402
from phase_times import pool_rows_for  # noqa: E402  (tools/ is this script's folder)


def pool_configs(shape: BufferShape, spec: str):
    """{label: pool_rows} for the default pools and each of --pool-rows."""
    out = {"whole": None}
    for item in spec.split(","):
        rows = pool_rows_for(item, shape)
        BufferShape(*shape_args(shape), rows)  # checks the value
        out[item] = rows
    return out


def shape_args(shape: BufferShape):
    """BufferShape's fields but pool_rows, for a copy with other pools."""
    return (shape.num_ranks, shape.num_experts, shape.num_max_tokens_per_rank, shape.num_topk, shape.hidden,
            shape.intermediate_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="v4flash", choices=sorted(REFERENCE_SHAPES))
    ap.add_argument("--tokens", default="1,128,2048,8192")
    ap.add_argument("--max-tokens", type=int, default=8192, help="the buffer's num_max_tokens_per_rank")
    ap.add_argument("--pool-rows", default="short128,short1024,4096")
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", action="store_true", help="compile the variants it loads, then exit")
    args = ap.parse_args()
    ref = REFERENCE_SHAPES[args.config]
    shape = BufferShape(1, ref.num_local_experts, args.max_tokens, ref.num_topk, ref.hidden, ref.intermediate_size)
    configs = pool_configs(shape, args.pool_rows)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.variants:
        from megamoe_plugin.jit import check_variants
        from megamoe_plugin.variants import variant_for

        wanted = {variant_for(BufferShape(*shape_args(shape), rows), "NVIDIA H200", 132, n, True, args.numerics)
                  for rows in configs.values() for n in tokens}
        return check_variants(sorted(wanted, key=lambda v: v.name()))

    import torch

    import megamoe_plugin as mm
    from megamoe_plugin.testing import fill_buffer, random_inputs, random_layer
    from megamoe_plugin.timing import graphed, l2_flusher, median_call_seconds

    gen = torch.Generator(device="cuda").manual_seed(24)
    H, I, K, E = ref.hidden, ref.intermediate_size, ref.num_topk, ref.num_local_experts
    layer = random_layer(E, H, I, "cuda", gen)
    flush = l2_flusher()
    bufs = {label: mm.get_symm_buffer(None, E, args.max_tokens, K, H, I, pool_rows=rows)
            for label, rows in configs.items()}
    print(f"{args.config}, buffer for {args.max_tokens} tokens, {args.numerics}; pools: "
          + ", ".join(f"{label} {rows or shape.pool_capacity} rows" for label, rows in configs.items()), flush=True)
    print(f"{'tokens':>6s} " + " ".join(f"{label:>12s}" for label in configs) + "   (us, median of rounds)")
    for n in tokens:
        inputs = random_inputs(n, H, E, K, "uniform", "cuda", gen)
        y = torch.full((n, H), math.nan, dtype=torch.bfloat16, device="cuda")
        replays = {}
        for label, buf in bufs.items():  # graphed runs the call once before it captures: inputs first
            fill_buffer(buf, inputs)
            replays[label] = graphed(lambda buf=buf: mm.fp8_mega_moe(y, layer.l1, layer.l2, buf,
                                                                      numerics=args.numerics))
        times = {label: [] for label in configs}
        labels = list(configs)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:  # rotate the order
                fill_buffer(bufs[label], inputs)
                times[label].append(median_call_seconds(replays[label], args.iters, before=flush) * 1e6)
        print(f"{n:6d} " + " ".join(f"{statistics.median(times[label]):12.1f}" for label in labels), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
