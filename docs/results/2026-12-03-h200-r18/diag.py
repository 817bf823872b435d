"""Diagnosis of round 18's two tolerance failures. MODE=exact: worst per-token error of exact BLOCK_M 32
on v3's shape, one_expert routing, fast_math False, over fresh seeds (run with each tree). MODE=grid:
small grid (4 CTAs) against the full grid bit for bit, every fast tier, every routing."""
import os, sys, math
import torch
import megamoe_plugin as mm
from megamoe_plugin.buffer import SymmBuffer
from megamoe_plugin.testing import random_inputs, random_layer, reference_outputs, fill_buffer
from megamoe_plugin.reference import token_rel_errors, calc_diff

def run(buf, layer, inputs, numerics, fast_math=True):
    n = fill_buffer(buf, inputs)
    y = torch.full((n, buf.hidden), math.nan, dtype=torch.bfloat16, device="cuda")
    mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, fast_math=fast_math, numerics=numerics)
    torch.cuda.synchronize()
    return y

def errs(y, inputs, layer, E, l1=None):
    ref = reference_outputs([inputs], [layer], E, None, l1)[0]
    t = token_rel_errors(y.double().flatten(1), ref.double().flatten(1))
    return float(t.max()), float(calc_diff(y.double(), ref.double()))

mode = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(7)
if mode == "exact":
    H, I, K, E, N = 7168, 2048, 8, 32, 24
    layer = random_layer(E, H, I, "cuda", g)
    buf = mm.get_symm_buffer(None, E, N, K, H, I)
    os.environ["MEGAMOE_BLOCK_M"] = "32"
    for numerics, fm in (("exact", False), ("exact", True), ("fast", False)):
        worst = []
        for seed in range(int(sys.argv[2])):
            inputs = random_inputs(N, H, E, K, "one_expert", "cuda", torch.Generator(device="cuda").manual_seed(1000 + seed))
            y = run(buf, layer, inputs, numerics, fm)
            worst.append(errs(y, inputs, layer, E))
        w = [a for a, _ in worst]
        print(f"{numerics} fast_math={fm} one_expert n={N}: worst token err max {max(w):.3e} median {sorted(w)[len(w)//2]:.3e}, "
              f"seeds over 1e-2: {sum(x > 1e-2 for x in w)}/{len(w)}, calc_diff max {max(c for _, c in worst):.2e}")
elif mode == "grid":
    H, I, K, E, N = 384, 256, 4, 4, 50
    layer = random_layer(E, H, I, "cuda", g)
    buf = mm.get_symm_buffer(None, E, N, K, H, I)
    storage = torch.zeros(buf.layout.total_bytes, dtype=torch.uint8, device="cuda")
    small = SymmBuffer(buf.shape, storage, 0, (storage.data_ptr(),), num_sms=4)
    for bm in (8, 16, 32, 64, 128):
        os.environ["MEGAMOE_BLOCK_M"] = str(bm)
        differ, worst = 0, 0.0
        for seed in range(int(sys.argv[2])):
            for routing in ("uniform", "one_expert", "half_empty", "masked"):
                inputs = random_inputs(N, H, E, K, routing, "cuda", torch.Generator(device="cuda").manual_seed(seed))
                ys = run(small, layer, inputs, "fast")
                yf = run(buf, layer, inputs, "fast")
                differ += not torch.equal(ys.view(torch.int16), yf.view(torch.int16))
                worst = max(worst, errs(yf, inputs, layer, E)[0])
        print(f"BLOCK_M {bm}: small grid differs from full grid in {differ} of {4 * int(sys.argv[2])} calls; "
              f"full grid worst token err vs exact ref {worst:.3e}")

if mode == "seq":
    # tests/gpu/single_gpu.py check_call_sequence's plan, exact BLOCK_M 32 on v3's shape, S fresh sequences.
    H, I, K, E, N = 7168, 2048, 8, 32, 24
    layer = random_layer(E, H, I, "cuda", torch.Generator(device="cuda").manual_seed(99))
    buf = mm.get_symm_buffer(None, E, N, K, H, I)
    os.environ["MEGAMOE_BLOCK_M"] = "32"
    plan = [(N, "uniform", None, True), (1, "uniform", None, True), (0, "uniform", None, True),
            (N // 2 | 1, "masked", 3.0, True), (N, "one_expert", None, False), (N - 3, "half_empty", 2.0, False),
            (N, "masked", None, True)]
    worst = [[] for _ in plan]
    seed = 5000
    for rep in range(int(sys.argv[2])):
        for i, (n, routing, clamp, fm) in enumerate(plan):
            seed += 1
            inputs = random_inputs(n, H, E, K, routing, "cuda", torch.Generator(device="cuda").manual_seed(seed))
            nn = fill_buffer(buf, inputs)
            y = torch.full((nn, H), math.nan, dtype=torch.bfloat16, device="cuda")
            mm.fp8_mega_moe(y, layer.l1, layer.l2, buf, activation_clamp=clamp, fast_math=fm, numerics="exact")
            torch.cuda.synchronize()
            if n:
                ref = reference_outputs([inputs], [layer], E, clamp, None)[0]
                worst[i].append(float(token_rel_errors(y.double().flatten(1), ref.double().flatten(1)).max()))
    for (n, routing, clamp, fm), w in zip(plan, worst):
        if w:
            print(f"exact BM32 n={n} {routing} clamp={clamp} fm={fm}: worst {max(w):.3e}, median {sorted(w)[len(w)//2]:.3e}, over 1e-2 {sum(x > 1e-2 for x in w)}/{len(w)}")
