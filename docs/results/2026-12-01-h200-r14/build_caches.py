"""Compiles, in the current tree, what run7.sh / run8.sh load beyond tests.gpu.cases (main: all of
it but the GPU tests). Usage: MEGAMOE_CACHE_DIR=... python3 build_caches.py main|epi"""
import dataclasses, sys
sys.path.insert(0, ".")
from tests.gpu.cases import call_variants
from megamoe_plugin.jit import check_variants

out = []
for H, I, K in ((7168, 2048, 8), (4096, 2048, 6)):  # outputs_digest.py: forced tiers on v3 / v4flash
    for numerics, tiers in (("fast", (64, 128)), ("exact", (64,))):
        for bm in tiers:
            out += call_variants(1, 32, K, H, I, 8192, 132, (True,), forced_block_m=bm, numerics_modes=(numerics,))
if sys.argv[1] == "main":
    for H, I, K in ((7168, 2048, 8), (4096, 2048, 6)):  # bench (both modes), tile_timeline, NCU
        out += call_variants(1, 32, K, H, I, 8192, 132, (True,))
        out += [dataclasses.replace(v, timeline=True)
                for v in call_variants(1, 32, K, H, I, 8192, 132, (True,), numerics_modes=("fast",))]
    out += call_variants(1, 4, 4, 384, 256, 16, 8, (True,), forced_block_m=128, numerics_modes=("fast",))  # racecheck
out = list(dict.fromkeys(out))
print(len(out), "variants")
sys.exit(1 if check_variants(out) else 0)
